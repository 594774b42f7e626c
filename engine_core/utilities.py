"""The engine's UTILITY methods, by name: what frontends (and through them the operator's endpoints) may
ask of the engine. Each takes the EngineCore and the call's arguments; errors in the caller's input are
InvalidParameterErrors (a 400 at the HTTP edge, or the status their code names).

Worker methods are reached only through the ones named here; collective_rpc only reaches
COLLECTIVE_RPC_METHODS (read-only reports: see worker/calls.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from engine_core import weight_updates
from engine_core.executor import CallTimeoutError
from protocol.errors import InvalidParameterError
from protocol.worker_messages import WorkerCall

# NOTE: the EngineCore, typed loosely here: it imports this module, and an import back (even for types
# only) would be a cycle the layering test refuses.
EngineCore = Any

# worker methods POST /collective_rpc may call: reports that change nothing (see worker/calls.py)
COLLECTIVE_RPC_METHODS = ("report_memory", "list_loras", "model_summary")
PAUSED_REASON = "paused"  # the stop_reason of requests a pause with mode abort ended


def _worker(
    engine: EngineCore, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
) -> Any:
    """Rank 0's result (every rank ran it; see _ranks for all of theirs)."""
    return _ranks(engine, method, *args, timeout_s=timeout_s, **kwargs)[0]


def _ranks(
    engine: EngineCore, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
) -> list[Any]:
    """Every tensor-parallel rank's result, rank 0 first (one rank: a list of one)."""
    try:
        answer = engine.executor.call(WorkerCall(method, list(args), kwargs), timeout_s)
    except CallTimeoutError as error:
        raise InvalidParameterError(
            "timeout", f"the worker did not answer {method} in time: {error}"
        ) from error
    if answer.error is not None:
        if answer.param is not None:
            raise InvalidParameterError(answer.param, answer.error)
        raise RuntimeError(answer.error)
    return [answer.result, *answer.per_rank]


def _stats(engine: EngineCore) -> dict[str, Any]:
    stats = engine.make_stats()
    return {field: getattr(stats, field) for field in stats.__struct_fields__}


def _check_invariants(engine: EngineCore) -> bool:
    engine.scheduler.check_invariants()
    return True


def _load_lora(engine: EngineCore, name: str, path: str, base_model_name: str | None, replace: bool) -> Any:
    adapter = engine.loras.load(name, path, base_model_name, replace, engine.scheduler.requests.values())
    return msgspec.to_builtins(adapter)


def _unload_lora(engine: EngineCore, name: str) -> Any:
    return msgspec.to_builtins(engine.loras.unload(name, engine.scheduler.requests.values()))


def _list_loras(engine: EngineCore) -> list[Any]:
    return [msgspec.to_builtins(adapter) for adapter in engine.loras.listed()]


def _pause_state(engine: EngineCore) -> dict[str, Any]:
    scheduler = engine.scheduler
    return {
        "is_paused": bool(engine.state.paused),
        "mode": engine.state.paused or None,
        # a preempted request counts as running: it goes on during a pause "wait"
        "num_running": len(scheduler.running) + scheduler.num_preempted_waiting,
        "num_waiting": len(scheduler.waiting) - scheduler.num_preempted_waiting,
    }


def _pause(engine: EngineCore, mode: str) -> dict[str, Any]:
    engine.state.pause(mode)
    if mode == "abort":
        request_ids = list(engine.scheduler.requests)
        engine.pending_outputs += engine.abort_requests(request_ids, PAUSED_REASON)
    return _pause_state(engine)


def _resume(engine: EngineCore) -> dict[str, Any]:
    engine.state.resume()
    return _pause_state(engine)


def _sleep_state(engine: EngineCore) -> dict[str, Any]:
    state = engine.state
    return {
        "is_sleeping": bool(state.sleeping),
        "level": state.sleep_level or None,
        "sleeping": state.sleeping,
    }


def _sleep(engine: EngineCore, level: int) -> dict[str, Any]:
    tags = engine.state.sleep_tags(level)
    if engine.has_unfinished_requests():
        raise InvalidParameterError(
            "level",
            f"{len(engine.scheduler.requests)} requests are open: let them finish, or POST /pause?mode=abort first.",
        )
    engine.scheduler.kv_cache.reset_prefix_cache()  # the KV pool's contents go with its memory
    report = _worker(engine, "sleep", level)
    engine.state.sleeping, engine.state.sleep_level = tags, level
    return {**_sleep_state(engine), "worker": report}


def _wake_up(engine: EngineCore, tags: list[str] | None = None) -> dict[str, Any]:
    waking = engine.state.wake_tags(tags)
    report = _worker(engine, "wake_up", waking) if waking else None
    engine.state.sleeping = [tag for tag in engine.state.sleeping if tag not in waking]
    if not engine.state.sleeping:
        engine.state.sleep_level = 0
    return {**_sleep_state(engine), "worker": report}


def _collective_rpc(
    engine: EngineCore, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float | None
) -> dict[str, Any]:
    if method not in COLLECTIVE_RPC_METHODS:
        raise InvalidParameterError(
            "method", f"collective_rpc calls only {', '.join(COLLECTIVE_RPC_METHODS)}, not {method!r}."
        )
    if timeout_s is not None and timeout_s <= 0:
        raise InvalidParameterError("timeout", "timeout must be a positive number of seconds.")
    return {"results": _ranks(engine, method, *args, timeout_s=timeout_s, **kwargs)}  # rank 0 first


def _start_profile(engine: EngineCore) -> Any:
    if engine.profiler_dir is None:
        raise InvalidParameterError("profiler", "profiling is off: start the server with --profiler-dir DIR.")
    return _worker(engine, "start_profile", engine.profiler_dir)


def _stop_profile(engine: EngineCore) -> Any:
    if engine.profiler_dir is None:
        raise InvalidParameterError("profiler", "profiling is off: start the server with --profiler-dir DIR.")
    return _worker(engine, "stop_profile")


# the calls that change the run state: every frontend is told at once (their admission and /health read it)
STATE_CHANGES = frozenset(
    {"pause", "resume", "sleep", "wake_up", "start_weight_update", "update_weights", "finish_weight_update"}
)

UTILITIES: dict[str, Callable[..., Any]] = {
    "reset_prefix_cache": lambda engine: engine.scheduler.kv_cache.reset_prefix_cache(),
    "get_stats": _stats,
    "check_invariants": _check_invariants,
    "load_lora": _load_lora,
    "unload_lora": _unload_lora,
    "list_loras": _list_loras,
    "pause": _pause,
    "resume": _resume,
    "is_paused": _pause_state,
    "sleep": _sleep,
    "wake_up": _wake_up,
    "is_sleeping": _sleep_state,
    "collective_rpc": _collective_rpc,
    "start_profile": _start_profile,
    "stop_profile": _stop_profile,
    **weight_updates.UTILITIES,
}


def call_utility(engine: EngineCore, method: str, args: list[Any]) -> Any:
    function = UTILITIES.get(method)
    if function is None:
        raise ValueError(f"unknown utility method {method!r}")
    return function(engine, *args)
