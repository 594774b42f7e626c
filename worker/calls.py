"""The worker methods the engine may call between steps (WorkerCall), by name: nothing else is reachable.

LoRA: add_lora, remove_lora, list_loras (the engine's table drives them); sleep and wake_up; the torch
profiler. collective_rpc, the operator's endpoint, reaches only engine_core/utilities.py's
COLLECTIVE_RPC_METHODS: reports that change nothing (report_memory, list_loras, model_summary), so an API
key holder cannot reach a method that rewrites weights or runs code.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from protocol.errors import InvalidParameterError
from protocol.lora import LoraRequest
from protocol.weight_transfer import InitInfo, UpdateInfo, parse
from protocol.worker_messages import WorkerCall, WorkerCallResult
from worker.host_memory import trim_freed_memory
from worker.sleep import Sleeper, model_tensors, rss_bytes, storages
from worker.weight_transfer import WeightReceiver, checkpoint_names

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner


class WorkerCalls:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sleeper = Sleeper(runner.config.cache_dir)
        self.profiler: Any = None  # a torch.profiler.profile while one runs
        self.profile_folder = ""
        self.receiver: WeightReceiver | None = None  # weight updates' (--weight-transfer-config)

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

    # ---- sleep and wake (worker/sleep.py) ----

    def _weights(self) -> list[torch.Tensor]:
        runner = self.runner
        extra = [] if runner.lora is None else [*runner.lora.slots.a.values(), *runner.lora.slots.bt.values()]
        return model_tensors(runner.model, extra)

    def call_sleep(self, level: int) -> dict[str, Any]:
        if self.runner.device.type != "cpu":
            raise InvalidParameterError("level", "sleep runs on the CPU worker so far, not on CUDA")
        return self.sleeper.sleep(level, self._weights(), self.runner.kv_caches)

    def call_wake_up(self, tags: list[str]) -> dict[str, Any]:
        before = rss_bytes()
        if "weights" in tags and "weights" in self.sleeper.asleep:
            rebuilt = None
            if self.sleeper.level == 2:
                extra = self._weights()[len(model_tensors(self.runner.model)) :]  # the LoRA slots
                for tensor in extra:
                    tensor.zero_()  # dropped with the rest; the manager fills them again on demand
                if self.runner.lora is not None:
                    self.runner.lora.clear_slots()
                rebuilt = model_tensors(self.runner.reload_model(), extra)
            self.sleeper.wake_weights(self._weights(), rebuilt)
        if "kv_cache" in tags:
            self.sleeper.wake_kv()
        gc.collect()
        trim_freed_memory()  # a level-2 wake's second copy of the model goes back to the kernel
        return {"rss_before": before, "rss_after": rss_bytes(), "asleep": sorted(self.sleeper.asleep)}

    # ---- weight updates for RL loops (worker/weight_transfer.py); the engine orders them ----

    def _receiver(self) -> WeightReceiver:
        config = self.runner.config.weight_transfer
        if config is None:
            raise InvalidParameterError(
                "init_info", "weight updates are off: start with --weight-transfer-config"
            )
        if self.receiver is None:
            self.receiver = WeightReceiver(config, self.runner.config.rank, self.runner.device)
        return self.receiver

    def call_init_weight_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        checkpoint_names(self.runner)  # a quantized model is refused before any rendezvous
        return self._receiver().init(parse(InitInfo, init_info, "init_info"))

    def call_start_weight_update(self) -> None:
        self._receiver().start()

    def call_update_weights(self, update_info: dict[str, Any]) -> int:
        info: UpdateInfo = parse(UpdateInfo, update_info, "update_info")
        info.check()
        return self._receiver().receive(info)

    def call_finish_weight_update(self) -> dict[str, Any]:
        report = self._receiver().finish(self.runner)
        gc.collect()
        trim_freed_memory()  # the rebuilt copy and the staged tensors go back to the kernel
        return report

    def call_abort_weight_update(self) -> None:
        if self.receiver is not None:
            self.receiver.staged = None

    # ---- collective_rpc's reports (engine_core/utilities.py COLLECTIVE_RPC_METHODS) ----

    def call_report_memory(self) -> dict[str, int]:
        """The worker's resident memory and what its KV cache and weights take."""
        weights = sum(s.nbytes() for s in storages(self._weights()))
        kv = sum(s.nbytes() for s in storages(self.runner.kv_caches))
        return {"rss_bytes": rss_bytes(), "weights_bytes": weights, "kv_cache_bytes": kv, "pid": os.getpid()}

    def call_model_summary(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "family": runner.model_config.family,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "num_layers": runner.model_config.num_layers,
            "num_kv_blocks": runner.num_kv_blocks,
            "batch_invariant": runner.batch_invariant,
        }

    # ---- the torch profiler (POST /start_profile, /stop_profile) ----

    def call_start_profile(self, folder: str) -> dict[str, Any]:
        if self.profiler is not None:
            raise InvalidParameterError("profiler", "a profile is already running: POST /stop_profile first.")
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(folder, exist_ok=True)
        self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.profiler.start()
        self.profile_folder = folder
        return {"started": True}

    def call_stop_profile(self) -> dict[str, Any]:
        if self.profiler is None:
            raise InvalidParameterError("profiler", "no profile is running: POST /start_profile first.")
        self.profiler.stop()
        path = os.path.join(
            self.profile_folder, f"worker-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        return {"trace": path}
