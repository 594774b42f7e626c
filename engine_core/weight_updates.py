"""Weight updates for RL loops, the engine's part (docs/rl-weight-updates.md): the UTILITY calls behind
vLLM's dev-mode routes, in their order, and the state /weight_info reports.

init_weight_transfer: every worker rank joins the trainer's group (a rendezvous: the trainer joins too).
start_weight_update: the engine pauses in the mode asked (as /pause: abort, wait or keep; none if it
was paused already) and the ranks open their staging areas. update_weights: the ranks receive the
tensors the trainer broadcasts. finish_weight_update: each rank builds the model from what it received
and copies it in; the prefix cache is emptied (its KV came from the old weights) and the engine resumes.
An update that fails at any step is dropped on every rank, the old weights keep serving, the engine
resumes, and /weight_info shows the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_core.run_state import PAUSE_MODES
from protocol.errors import InvalidParameterError

EngineCore = Any  # typed loosely: see engine_core/utilities.py


@dataclass
class WeightUpdates:
    num_ranks: int = 1  # the engine's worker ranks: a trainer's group has them and itself
    version: str | None = None  # the trainer's label for the served weights (/update_weight_version)
    group: dict[str, Any] | None = None  # the ranks' answers to init (their ranks in the group)
    updating: bool = False
    paused_by_update: bool = False  # the update paused the engine (and resumes it)
    num_tensors: int = 0  # received in the open update
    num_updates: int = 0  # finished since start
    last_error: str | None = None
    last_update_at: float | None = None


def _state(engine: EngineCore) -> WeightUpdates:
    if engine.weight_transfer is None:
        raise InvalidParameterError(
            "weight_transfer", "weight updates are off: start the server with --weight-transfer-config"
        )
    state: WeightUpdates = engine.weight_updates
    return state


def _ranks(engine: EngineCore, method: str, *args: Any) -> list[Any]:
    from engine_core.utilities import _ranks as ranks

    timeout_s = engine.weight_transfer.timeout_s + 30  # the ranks' own timeout fails first
    return ranks(engine, method, *args, timeout_s=timeout_s)


def _failed(engine: EngineCore, state: WeightUpdates, error: Exception) -> InvalidParameterError:
    """Drop the open update everywhere (the old weights keep serving); the error to answer with."""
    state.last_error = str(error.message if isinstance(error, InvalidParameterError) else error)
    if state.updating:
        try:
            _ranks(engine, "abort_weight_update")
        finally:
            _end(engine, state)
    if isinstance(error, InvalidParameterError):
        return error
    message = f"the weight update failed, the served weights are unchanged: {error}"
    return InvalidParameterError("update", message, "weight_transfer_failed")


def _end(engine: EngineCore, state: WeightUpdates) -> None:
    state.updating, state.num_tensors = False, 0
    if state.paused_by_update:
        state.paused_by_update = False
        engine.state.resume()


def init_weight_transfer(engine: EngineCore, init_info: dict[str, Any]) -> dict[str, Any]:
    state = _state(engine)
    if state.updating:
        raise InvalidParameterError("init_info", "an update is open: finish it first")
    state.group = None
    try:
        answers = _ranks(engine, "init_weight_transfer", init_info)
    except Exception as error:
        raise _failed(engine, state, error) from error
    state.group = {"backend": engine.weight_transfer.backend, "ranks": [a["rank"] for a in answers],
                   "world_size": answers[0]["world_size"]}  # fmt: skip
    return state.group


def start_weight_update(engine: EngineCore, mode: str) -> dict[str, Any]:
    state = _state(engine)
    if mode not in PAUSE_MODES:
        raise InvalidParameterError("mode", f"mode takes {', '.join(PAUSE_MODES)}, got {mode!r}")
    if state.updating:
        raise InvalidParameterError("update", "an update is open already")
    if state.group is None:
        raise InvalidParameterError(
            "init_info", "no weight transfer group: POST /init_weight_transfer_engine first"
        )
    if not engine.state.paused:
        from engine_core.utilities import _pause

        _pause(engine, mode)
        state.paused_by_update = True
    state.updating, state.num_tensors, state.last_error = True, 0, None
    try:
        _ranks(engine, "start_weight_update")
    except Exception as error:
        raise _failed(engine, state, error) from error
    return weight_info(engine)


def update_weights(engine: EngineCore, update_info: dict[str, Any]) -> dict[str, Any]:
    state = _state(engine)
    if not state.updating:
        raise InvalidParameterError("update_info", "no update is open: POST /start_weight_update first")
    try:
        counts = _ranks(engine, "update_weights", update_info)
    except Exception as error:
        raise _failed(engine, state, error) from error
    state.num_tensors += counts[0]
    return weight_info(engine)


def finish_weight_update(engine: EngineCore) -> dict[str, Any]:
    state = _state(engine)
    if not state.updating:
        raise InvalidParameterError("update", "no update is open: POST /start_weight_update first")
    try:
        _ranks(engine, "finish_weight_update")
    except Exception as error:
        raise _failed(engine, state, error) from error
    engine.scheduler.kv_cache.reset_prefix_cache()  # cached blocks hold the old weights' KV
    state.num_updates += 1
    state.last_update_at = time.time()
    _end(engine, state)
    return weight_info(engine)


def update_weight_version(engine: EngineCore, version: str) -> dict[str, Any]:
    _state(engine).version = version
    return weight_info(engine)


def weight_info(engine: EngineCore) -> dict[str, Any]:
    state = _state(engine)
    return {
        "weight_version": state.version,
        "world_size": state.num_ranks,
        "backend": engine.weight_transfer.backend,
        "group": state.group,
        "updating": state.updating,
        "num_tensors_received": state.num_tensors,
        "num_updates": state.num_updates,
        "last_update_at": state.last_update_at,
        "last_error": state.last_error,
        "is_paused": bool(engine.state.paused),
    }


UTILITIES: dict[str, Callable[..., Any]] = {
    "init_weight_transfer": init_weight_transfer,
    "start_weight_update": start_weight_update,
    "update_weights": update_weights,
    "finish_weight_update": finish_weight_update,
    "update_weight_version": update_weight_version,
    "weight_info": weight_info,
}
