"""The worker methods the engine may call between steps (WorkerCall), by name: nothing else is reachable.

LoRA: add_lora, remove_lora, list_loras (the engine's table drives them). collective_rpc, the operator's
endpoint, reaches only COLLECTIVE_RPC_METHODS (frontend/server/operator.py says why those).
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

import msgspec

from protocol.errors import InvalidParameterError
from protocol.lora import LoraRequest
from protocol.worker_messages import WorkerCall, WorkerCallResult

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner


class WorkerCalls:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def handle(self, call: WorkerCall) -> WorkerCallResult:
        method = getattr(self, f"call_{call.method}", None)
        if method is None:
            return WorkerCallResult(error=f"the worker has no method {call.method!r}", param="method")
        try:
            return WorkerCallResult(result=method(*call.args, **call.kwargs))
        except InvalidParameterError as error:
            return WorkerCallResult(error=error.message, param=error.param)
        except TypeError as error:
            return WorkerCallResult(error=f"{call.method}: {error}", param="args")
        except Exception as error:  # a call's failure is its caller's answer, not the worker's death
            traceback.print_exc()
            return WorkerCallResult(error=f"{type(error).__name__}: {error}")

    def _lora(self) -> Any:
        if self.runner.lora is None:
            raise InvalidParameterError(
                "lora_name", "LoRA is not enabled: start the server with --enable-lora"
            )
        return self.runner.lora

    def call_add_lora(self, lora: dict[str, Any]) -> dict[str, int]:
        return self._lora().add(msgspec.convert(lora, LoraRequest))  # type: ignore[no-any-return]

    def call_remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)  # type: ignore[no-any-return]

    def call_list_loras(self) -> list[int]:
        return self._lora().list_ids()  # type: ignore[no-any-return]
