"""Pause (abort, wait, keep), resume, sleep (levels 1 and 2) and wake on the EngineCore with the in-process
executor and a tiny random Llama: the real scheduler and worker, greedy tokens compared with an
uninterrupted run."""

from __future__ import annotations

import json
import pathlib

import pytest

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS
from tests.test_correctness_tiny import build_tiny
from worker.executor import InprocExecutor

PROMPTS = [[5, 9, 11, 200, 3], [7] * 30, [100, 101, 102]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    path = str(tmp_path_factory.mktemp("tiny-run-state"))
    build_tiny("llama", path)
    return path


def engine(folder: str, **kwargs) -> EngineCore:  # type: ignore[no-untyped-def]
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, num_kv_blocks=TINY_KV_TOKENS // 16)
    return EngineCore(EngineConfig(worker=worker, **kwargs), InprocExecutor(worker))


def add(core: EngineCore, index: int, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core.add_request(
        AddRequest(
            request_id=f"r{index}", prompt_token_ids=prompt, sampling_params=params, arrival_time=index
        )
    )


def drain(core: EngineCore, tokens: dict[str, list[int]], finish: dict[str, str] | None = None) -> None:
    while core.can_step():
        for _, output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if finish is not None and output.finish_reason:
                finish[output.request_id] = output.finish_reason
        core.scheduler.check_invariants()


@pytest.fixture(scope="module")
def uninterrupted(folder: str) -> dict[str, list[int]]:
    core = engine(folder)
    for i, prompt in enumerate(PROMPTS):
        add(core, i, prompt)
    tokens: dict[str, list[int]] = {}
    drain(core, tokens)
    return tokens


def test_pause_keep_freezes_and_resumes_exactly(folder: str, uninterrupted) -> None:  # type: ignore[no-untyped-def]
    core = engine(folder)
    for i, prompt in enumerate(PROMPTS):
        add(core, i, prompt)
    tokens: dict[str, list[int]] = {}
    for _ in range(6):
        for _, output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    core.call_utility("pause", ["keep"])
    drain(core, tokens)  # collects what was in flight, then stops
    frozen = {k: list(v) for k, v in tokens.items()}
    assert not core.can_step() and core.scheduler.running, "running requests keep their place"
    add(core, 9, PROMPTS[0])  # queued while paused
    assert not core.can_step() and core.step() == [] and tokens == frozen
    assert core.call_utility("is_paused", [])["mode"] == "keep"
    core.call_utility("resume", [])
    drain(core, tokens)
    assert {k: tokens[k] for k in uninterrupted} == uninterrupted
    assert tokens["r9"] == uninterrupted["r0"]


def test_pause_wait_finishes_running_and_holds_new(folder: str, uninterrupted) -> None:  # type: ignore[no-untyped-def]
    core = engine(folder)
    add(core, 0, PROMPTS[0])
    tokens: dict[str, list[int]] = {}
    core.step()
    core.call_utility("pause", ["wait"])
    add(core, 1, PROMPTS[1])
    drain(core, tokens)
    assert tokens["r0"] == uninterrupted["r0"] and "r1" not in tokens
    assert core.call_utility("is_paused", []) == {
        "is_paused": True,
        "mode": "wait",
        "num_running": 0,
        "num_waiting": 1,
    }
    core.call_utility("resume", [])
    drain(core, tokens)
    assert tokens["r1"] == uninterrupted["r1"]


def test_pause_abort_ends_requests_and_refuses_new(folder: str) -> None:
    core = engine(folder)
    add(core, 0, PROMPTS[0])
    add(core, 1, PROMPTS[1])
    core.step()
    core.call_utility("pause", ["abort"])
    ended = core.take_pending_outputs()
    assert sorted(o.request_id for _, o in ended) == ["r0", "r1"]
    assert all(o.finish_reason == "abort" and o.stop_reason == "paused" for _, o in ended)
    with pytest.raises(InvalidParameterError) as refused:
        add(core, 2, PROMPTS[0])
    assert refused.value.code == "engine_paused"
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    with pytest.raises(InvalidParameterError, match="mode must be one of"):
        core.call_utility("pause", ["later"])
    core.call_utility("resume", [])
    add(core, 3, PROMPTS[0])
    drain(core, {})


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_tokens(folder: str, uninterrupted, level: int) -> None:  # type: ignore[no-untyped-def]
    core = engine(folder)
    add(core, 0, PROMPTS[0])
    with pytest.raises(InvalidParameterError, match="requests are open"):
        core.call_utility("sleep", [level])
    drain(core, {})
    asleep = core.call_utility("sleep", [level])
    assert asleep["is_sleeping"] and asleep["level"] == level
    assert asleep["worker"]["released"] > 0
    with pytest.raises(InvalidParameterError) as refused:
        add(core, 1, PROMPTS[1])
    assert refused.value.code == "engine_sleeping"
    with pytest.raises(InvalidParameterError, match="unknown tags"):
        core.call_utility("wake_up", [["everything"]])
    partly = core.call_utility("wake_up", [["weights"]])
    assert partly["is_sleeping"] and partly["sleeping"] == ["kv_cache"]
    assert core.call_utility("wake_up", [None])["is_sleeping"] is False
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        add(core, i + 10, prompt)
    drain(core, tokens)
    assert [tokens[f"r{i + 10}"] for i in range(len(PROMPTS))] == [
        uninterrupted[f"r{i}"] for i in range(len(PROMPTS))
    ]


def test_collective_rpc_reaches_only_its_allowlist(folder: str) -> None:
    core = engine(folder)
    report = core.call_utility("collective_rpc", ["report_memory", [], {}, None])
    memory = report["results"][0]
    assert memory["rss_bytes"] > memory["weights_bytes"] > 0 and memory["kv_cache_bytes"] > 0  # the pool may
    # not be faulted in yet: RSS need not hold it
    for method in ("sleep", "add_lora", "__init__"):
        with pytest.raises(InvalidParameterError, match="collective_rpc calls only"):
            core.call_utility("collective_rpc", [method, [], {}, None])
    with pytest.raises(InvalidParameterError, match="profiling is off"):
        core.call_utility("start_profile", [])


def test_the_profiler_writes_a_trace(folder: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    core = engine(folder, profiler_dir=str(tmp_path))
    core.call_utility("start_profile", [])
    add(core, 0, PROMPTS[0])
    drain(core, {})
    trace = core.call_utility("stop_profile", [])["trace"]
    events = json.loads(pathlib.Path(trace).read_text())["traceEvents"]
    assert trace.startswith(str(tmp_path)) and any(e.get("name", "").startswith("aten::") for e in events)
    with pytest.raises(InvalidParameterError, match="no profile is running"):
        core.call_utility("stop_profile", [])


def test_pause_wait_lets_preempted_requests_finish_too(folder: str, uninterrupted) -> None:  # type: ignore[no-untyped-def]
    """A pool so small that the running requests preempt each other: under pause "wait" the preempted go
    back to running (they had started), so every request finishes and nothing hangs."""
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, num_kv_blocks=4, max_model_len=64)
    core = EngineCore(EngineConfig(worker=worker, max_num_batched_tokens=32), InprocExecutor(worker))
    for i, prompt in enumerate(PROMPTS):
        add(core, i, prompt)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for _, output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    core.call_utility("pause", ["wait"])
    finish: dict[str, str] = {}
    drain(core, tokens, finish)
    assert core.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    started = {request_id for request_id in tokens if tokens[request_id]}
    assert core.call_utility("is_paused", [])["num_running"] == 0
    core.call_utility("resume", [])
    drain(core, tokens, finish)
    assert {k: tokens[k] for k in uninterrupted} == uninterrupted and set(finish) == set(uninterrupted)
    assert started  # some had begun before the pause
