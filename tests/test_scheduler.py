"""Scheduler and KV cache manager against a fake executor: numbers only, no torch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.block_pool import BlockPool
from engine_core.engine_core import EngineCore
from engine_core.hybrid_kv_cache import HybridKVCacheManager
from engine_core.request import RequestStatus
from protocol.config import EngineConfig, WorkerConfig
from protocol.lora import LoraAdapter, LoraConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.fake_executor import FakeExecutor


def make_core(
    num_kv_blocks: int = 64,
    block_size: int = 4,
    lora: LoraConfig | None = None,
    window: int = 0,
    num_window_blocks: int = 0,
    rope_switch_len: int = 0,
    **kwargs,
) -> tuple[EngineCore, FakeExecutor]:  # type: ignore[no-untyped-def]
    executor = FakeExecutor(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        window=window,
        num_window_blocks=num_window_blocks,
        rope_switch_len=rope_switch_len,
    )
    kwargs.setdefault("async_scheduling", False)  # these tests follow one step at a time
    config = EngineConfig(worker=WorkerConfig(model="fake", lora=lora), **kwargs)
    return EngineCore(config, executor), executor


def add(core: EngineCore, request_id: str, prompt: list[int], **params) -> None:  # type: ignore[no-untyped-def]
    params.setdefault("ignore_eos", True)
    core.add_request(
        AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(**params),
            arrival_time=float(len(core.scheduler.requests)),
            priority=params.pop("priority", 0) if "priority" in params else 0,
        )
    )


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for _, output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.scheduler.check_invariants()
    assert not core.has_unfinished_requests()
    return outputs


def test_block_pool_lru_and_lazy_eviction() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h1", b"h2"], 0, 2)
    pool.free_blocks([b, a])  # tail first: b is evicted before a
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"h1") is a  # still cached while free
    new = pool.get_new_blocks(3)  # two untouched blocks, then b (evicted lazily)
    assert b in new and a not in new
    assert pool.get_cached_block(b"h2") is None and pool.get_cached_block(b"h1") is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_invariants()


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@ASYNC
def test_chunked_prefill_respects_budget_and_finishes(async_scheduling: bool) -> None:
    core, executor = make_core(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    add(core, "a", list(range(40)), max_tokens=3)
    add(core, "b", list(range(100, 110)), max_tokens=3)
    outputs = run_to_completion(core)
    assert all(step.total_num_scheduled_tokens <= 16 for step in executor.steps)
    assert [len(o.new_token_ids) for o in outputs["a"]] == [1, 1, 1]
    assert outputs["a"][-1].finish_reason == "length"
    assert core.scheduler.kv_cache.pool.num_free_blocks == 64


def test_mixed_batch_decodes_with_prefill_chunks() -> None:
    core, executor = make_core(max_num_batched_tokens=8)
    add(core, "a", [1, 2, 3], max_tokens=5)
    core.step()
    add(core, "b", list(range(20)), max_tokens=2)
    core.step()
    step = executor.steps[-1]
    assert step.num_scheduled_tokens == {"a": 1, "b": 7}
    run_to_completion(core)


@ASYNC
def test_eos_stop_tokens_min_tokens(async_scheduling: bool) -> None:
    core, executor = make_core(async_scheduling=async_scheduling)
    add(core, "eos", [1, 2], ignore_eos=False, max_tokens=10)
    executor.token_for["eos"] = [5, 2, 6]
    add(core, "stop_id", [1, 2], stop_token_ids=[6], max_tokens=10)
    executor.token_for["stop_id"] = [5, 6]
    add(core, "ignore", [1, 2], max_tokens=3)
    executor.token_for["ignore"] = [2, 2, 2, 2]
    outputs = run_to_completion(core)
    assert [o.new_token_ids[0] for o in outputs["eos"]] == [5, 2]
    assert outputs["eos"][-1].finish_reason == "stop" and outputs["eos"][-1].stop_reason is None
    assert outputs["stop_id"][-1].finish_reason == "stop" and outputs["stop_id"][-1].stop_reason == 6
    assert len(outputs["ignore"]) == 3 and outputs["ignore"][-1].finish_reason == "length"


@ASYNC
def test_max_model_len_caps_output(async_scheduling: bool) -> None:
    core, executor = make_core()
    executor.model_info.max_model_len = 10
    core2 = EngineCore(
        EngineConfig(worker=WorkerConfig(model="fake"), async_scheduling=async_scheduling), executor
    )
    add(core2, "a", list(range(8)), max_tokens=100)
    outputs = run_to_completion(core2)
    assert len(outputs["a"]) == 2 and outputs["a"][-1].finish_reason == "length"
    assert sum(step.num_scheduled_tokens.get("a", 0) for step in executor.steps) == 9  # never past the limit


def test_prefix_cache_hit_reports_cached_tokens() -> None:
    core, _ = make_core()
    prefix = list(range(50, 70))
    add(core, "a", prefix + [1], max_tokens=1)
    run_to_completion(core)
    add(core, "b", prefix + [2, 3], max_tokens=1)
    outputs = run_to_completion(core)
    assert outputs["b"][-1].num_cached_tokens == 20
    stats = core.make_stats()
    assert stats.prefix_cache_hits == 20


def test_prefix_caching_off_never_hits() -> None:
    core, _ = make_core(enable_prefix_caching=False)
    add(core, "a", list(range(20)), max_tokens=1)
    run_to_completion(core)
    add(core, "b", list(range(20)), max_tokens=1)
    outputs = run_to_completion(core)
    assert outputs["b"][-1].num_cached_tokens == 0


@ASYNC
def test_preemption_when_blocks_run_out(async_scheduling: bool) -> None:
    core, executor = make_core(num_kv_blocks=8, block_size=4, async_scheduling=async_scheduling)
    for i in range(3):
        add(core, f"r{i}", list(range(i * 10, i * 10 + 6)), max_tokens=12)
    outputs = run_to_completion(core)
    assert core.scheduler.num_preemptions > 0
    for i in range(3):
        tokens = [t for o in outputs[f"r{i}"] for t in o.new_token_ids]
        assert len(tokens) == 12
    assert any(step.preempted_request_ids for step in executor.steps)
    assert core.scheduler.kv_cache.pool.num_free_blocks == 8


def test_priority_policy_runs_urgent_first_and_preempts_lowest() -> None:
    core, executor = make_core(num_kv_blocks=6, block_size=4, scheduling_policy="priority", max_num_seqs=1)
    core.add_request(
        AddRequest(
            request_id="low",
            prompt_token_ids=[1] * 5,
            sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
            arrival_time=0.0,
            priority=5,
        )
    )
    core.add_request(
        AddRequest(
            request_id="high",
            prompt_token_ids=[2] * 5,
            sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
            arrival_time=1.0,
            priority=-5,
        )
    )
    core.step()
    assert list(executor.steps[0].num_scheduled_tokens) == ["high"]
    run_to_completion(core)


@ASYNC
def test_abort_frees_blocks_and_is_idempotent(async_scheduling: bool) -> None:
    core, executor = make_core(async_scheduling=async_scheduling)
    add(core, "a", list(range(30)), max_tokens=50)
    add(core, "w", list(range(5)), max_tokens=50)
    core.step()
    aborted = core.abort_requests(["a", "a", "unknown", "w"])
    assert [o.finish_reason for _, o in aborted] == ["abort", "abort"]
    assert core.scheduler.kv_cache.pool.num_free_blocks == 64
    while core.has_unfinished_requests():  # async: the step in flight
        assert core.step() == []  # nothing of an aborted request comes back
        core.scheduler.check_invariants()
    add(core, "b", [1, 2], max_tokens=1)
    run_to_completion(core)  # the next step tells the worker to drop "a" and "w"
    assert "a" in executor.steps[-1].finished_request_ids or "a" in executor.steps[-2].finished_request_ids
    assert set(executor.num_tokens) == {"b"}


def test_async_scheduling_submits_the_next_step_before_collecting_the_last() -> None:
    core, executor = make_core(async_scheduling=True)
    add(core, "a", [1, 2, 3], max_tokens=3)
    assert core.step() == [] and len(executor.submitted) == 1  # the queue fills before anything returns
    for expected in (1, 2):
        ((_, output),) = core.step()
        assert len(output.new_token_ids) == 1 and len(executor.steps) == expected
        assert len(executor.submitted) == 1  # the next step was already waiting for the worker
    # The third token is the last (max_tokens): nothing more is scheduled, the last step is collected.
    ((_, output),) = core.step()
    assert output.finish_reason == "length" and not executor.submitted
    assert [step.num_scheduled_tokens for step in executor.steps] == [{"a": 3}, {"a": 1}, {"a": 1}]
    assert not core.has_unfinished_requests()


def test_async_scheduling_collects_before_scheduling_once_a_request_ends() -> None:
    """A client sends its next request when one ends: the step after an ending is scheduled only once the
    step in flight is back, so a request that arrives meanwhile is not a step late."""
    core, executor = make_core(async_scheduling=True)
    add(core, "short", [1, 2], max_tokens=2)
    add(core, "long", [3, 4], max_tokens=20)
    add(core, "aborted", [5, 6], max_tokens=20)
    core.step()  # submits the first step
    core.step()  # submits the second, collects the first
    assert len(executor.submitted) == 1
    (finished,) = [output for _, output in core.step() if output.finish_reason]  # "short" ends
    assert finished.request_id == "short" and len(executor.submitted) == 1
    core.step()  # one step at a time now: nothing submitted, the step in flight collected
    assert not executor.submitted
    add(core, "next", [7, 8], max_tokens=5)  # arrives while no step is in flight
    core.step()
    assert "next" in executor.submitted[0].num_scheduled_tokens
    assert all(not output.finish_reason for _, output in core.step())  # two in flight again
    assert len(executor.submitted) == 1
    core.abort_requests(["aborted"])
    core.step()
    assert not executor.submitted  # an abort ends a request too
    run_to_completion(core)


def test_async_scheduling_gives_each_request_the_outputs_sync_does() -> None:
    def run(async_scheduling: bool) -> tuple[dict[str, list], FakeExecutor]:
        core, executor = make_core(max_num_batched_tokens=12, async_scheduling=async_scheduling)
        scripts = {
            "eos": ([1, 2, 3], dict(ignore_eos=False, max_tokens=20), [5, 7, 2, 9, 9]),
            "stop": ([4] * 9, dict(stop_token_ids=[8], max_tokens=20), [5, 8, 9, 9]),
            "min": ([6] * 5, dict(ignore_eos=False, min_tokens=3, max_tokens=20), [5, 2, 9, 2, 9]),
            "length": ([7] * 20, dict(max_tokens=4), [9] * 8),
        }
        for request_id, (prompt, params, script) in scripts.items():
            add(core, request_id, prompt, **params)
            executor.token_for[request_id] = list(script)
        return run_to_completion(core), executor

    sync_outputs, _ = run(False)
    async_outputs, executor = run(True)
    summary = {
        request_id: ([t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason)
        for request_id, outputs in async_outputs.items()
    }
    assert summary == {
        request_id: ([t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason)
        for request_id, outputs in sync_outputs.items()
    }
    assert summary["eos"] == ([5, 7, 2], "stop") and summary["min"] == ([5, 2, 9, 2], "stop")
    # A request that stops on a token runs at most one step past it; one capped by length never does.
    computed = {rid: sum(step.num_scheduled_tokens.get(rid, 0) for step in executor.steps) for rid in summary}
    assert computed["length"] == 20 + 3 and computed["eos"] <= 3 + 3


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 64),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    async_scheduling=st.booleans(),
    loras=st.booleans(),
    window=st.sampled_from([0, 0, 3, 6, 9]),
)
def test_random_workload_keeps_invariants_and_leaks_nothing(
    seed: int,
    num_blocks: int,
    budget: int,
    caching: bool,
    policy: str,
    async_scheduling: bool,
    loras: bool,
    window: int,
) -> None:
    """With loras: requests on three adapters and the base, at most two adapters a step (check_invariants),
    adapters unloaded and loaded again while requests use them; the worker drops each once unused.
    With a window: a model mixing windowed and full layers, its windowed pool as small as one request's
    window and two steps' chunks need (so that pool runs short too, and preempts)."""
    rng = random.Random(seed)
    names = ["a", "b", "c"] if loras else []
    one_request = -(-window // 4) + 2 * -(-budget // 4) + 3
    num_window_blocks = min(num_blocks, one_request + rng.randint(0, 4)) if window else 0
    core, executor = make_core(
        window=window,
        num_window_blocks=num_window_blocks,
        lora=LoraConfig(max_loras=2) if loras else None,
        lora_modules=[LoraAdapter(name=name, path=f"/adapters/{name}") for name in names],
        num_kv_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        scheduling_policy=policy,
        max_num_seqs=rng.randint(1, 8),
        async_scheduling=async_scheduling,
    )
    shared = [rng.randrange(100) for _ in range(8)]
    live: list[str] = []
    for step in range(200):
        if rng.random() < 0.3 and len(core.scheduler.requests) < 12:
            request_id = f"r{step}"
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(100) for _ in range(rng.randint(1, 12))
            ]
            core.add_request(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(
                        max_tokens=rng.randint(1, 10), ignore_eos=rng.random() < 0.5
                    ),
                    arrival_time=float(step),
                    priority=rng.randint(-2, 2),
                    lora_name=rng.choice([None, *names]) if names else None,
                )
            )
            executor.token_for[request_id] = [rng.choice([2, 5, 7]) for _ in range(12)]
            live.append(request_id)
        if names and rng.random() < 0.03:  # unload one and load it again (a new id) while requests may use it
            name = rng.choice(names)
            core.call_utility("unload_lora", [name])
            core.call_utility("load_lora", [name, f"/adapters/{name}", None, False])
        if live and rng.random() < 0.05:
            core.abort_requests([rng.choice(live)])
        scheduler_output_count = len(executor.steps)
        core.step()
        core.scheduler.check_invariants(
            executor.steps[-1] if len(executor.steps) > scheduler_output_count else None
        )
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        core.step()
        core.scheduler.check_invariants()
    assert not core.has_unfinished_requests()
    kv = core.scheduler.kv_cache
    for pool in [kv.pool] + ([kv.sliding.pool] if isinstance(kv, HybridKVCacheManager) else []):
        assert pool.num_free_blocks == pool.num_blocks
        assert all(block.ref_cnt == 0 for block in pool.blocks)
    for request in list(core.scheduler.requests.values()):
        assert request.status.is_finished  # pragma: no cover
    assert not core.loras.retiring, "every unloaded adapter was freed once its requests ended"
    loaded = {call.args[0][0] for call in executor.calls if call.method == "add_lora"}  # [id, name, path]
    removed = {call.args[0] for call in executor.calls if call.method == "remove_lora"}
    assert removed | {a.lora_id for a in core.loras.listed()} == loaded


def test_request_status_order() -> None:
    assert not RequestStatus.PREEMPTED.is_finished
    assert (
        RequestStatus.FINISHED_ABORTED.is_finished and RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_worker_error_finishes_its_request_only(async_scheduling: bool) -> None:
    """A request the worker cannot go on with (its grammar failed) ends with finish_reason "error" and
    its error; the token sampled without the constraint is never shown; the others run on."""
    core, executor = make_core(async_scheduling=async_scheduling)
    executor.fail["bad"] = "the grammar did not compile in time"
    add(core, "bad", [1, 2, 3], max_tokens=4)
    add(core, "good", [4, 5, 6], max_tokens=4)
    outputs = run_to_completion(core)
    (bad,) = outputs["bad"]
    assert bad.finish_reason == "error" and bad.new_token_ids == []
    assert bad.error is not None and bad.error.param == "structured_outputs"
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 4
    assert outputs["good"][-1].finish_reason == "length"
    assert core.make_stats().kv_cache_usage == 0.0, "no block left behind"
    core.scheduler.check_invariants()


def test_while_requests_decode_a_step_prefills_at_most_the_decode_prefill_budget() -> None:
    """--decode-prefill-token-budget: a decode row waits through at most that much prefill a step; with
    no request decoding, prefills take the whole budget (a burst's first step is not slowed)."""
    core, executor = make_core(max_num_batched_tokens=64, decode_prefill_token_budget=8)
    add(core, "a", list(range(40)), max_tokens=30)
    add(core, "b", list(range(100, 150)), max_tokens=30)
    core.step()
    first = executor.steps[-1].num_scheduled_tokens
    assert sum(first.values()) == 64  # nobody decodes yet: the whole budget
    outputs = run_to_completion(core)
    assert {"a", "b"} <= set(outputs)
    mixed = [
        s for s in executor.steps if 1 in s.num_scheduled_tokens.values() and len(s.num_scheduled_tokens) > 1
    ]
    assert mixed and all(sum(c for c in s.num_scheduled_tokens.values() if c > 1) <= 8 for s in mixed), (
        "a step with a decode row carries at most 8 prefill tokens"
    )


def mixed_steps_of_six_decoding_and_a_long_prompt(**flags: int) -> list[tuple[int, int]]:
    """Six short requests decode while a 200-token prompt is prefilled (step budget 64, prefill share 8 and
    `flags`): each step after the first with both kinds of rows, as (decoding rows, prefill tokens)."""
    core, executor = make_core(max_num_batched_tokens=64, decode_prefill_token_budget=8, **flags)
    for i in range(6):
        add(core, f"short{i}", list(range(10 * i, 10 * i + 5)), max_tokens=40)
    add(core, "long", list(range(300, 500)), max_tokens=4)
    outputs = run_to_completion(core)
    assert {"long", *(f"short{i}" for i in range(6))} <= set(outputs)
    core.scheduler.check_invariants()
    mixed = []
    for step in executor.steps[1:]:
        counts = step.num_scheduled_tokens
        decoding = sum(1 for c in counts.values() if c == 1)
        prefill = sum(c for c in counts.values() if c > 1)
        if decoding and prefill:
            mixed.append((decoding, prefill))
    return mixed


def test_the_prefill_share_grows_with_the_decoding_requests() -> None:
    """--decode-prefill-tokens-per-decode: beside d decoding requests a step prefills at most
    max(budget, per_decode x d) tokens, and more than the fixed budget once enough decode."""
    mixed = mixed_steps_of_six_decoding_and_a_long_prompt(decode_prefill_tokens_per_decode=4)
    for decoding, prefill in mixed:
        assert prefill <= max(8, 4 * decoding), (decoding, prefill)
    assert mixed and max(prefill for _, prefill in mixed) == 24  # six decoding: 4 x 6 prefill tokens, not 8


def test_the_prefill_share_grows_with_the_requests_held() -> None:
    """--decode-prefill-tokens-per-request: the share counts every request the engine holds, the one still
    prefilling too: seven held (six decoding, one long prompt) give 4 x 7 = 28 prefill tokens a step, where
    counting the decoding ones would give 24 and the fixed budget 8."""
    shares = [
        prefill
        for _, prefill in mixed_steps_of_six_decoding_and_a_long_prompt(decode_prefill_tokens_per_request=4)
    ]
    assert shares and max(shares) == 28 and all(share <= 28 for share in shares)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_longrope_request_crossing_its_switch_is_recomputed_once_under_its_own_keys(
    async_scheduling: bool,
) -> None:
    """LongRoPE (switch at 10 tokens): a request that grows past it is sent to the worker again whole (its
    KV recomputed on the long factors, as transformers does) and keeps its outputs; one that starts past it
    runs long from the start; and a short request's cached blocks never serve a long one."""
    core, executor = make_core(rope_switch_len=10, async_scheduling=async_scheduling)
    prompt = list(range(100, 108))
    add(core, "crosses", prompt, max_tokens=8)
    outputs = run_to_completion(core)
    tokens = [t for output in outputs["crosses"] for t in output.new_token_ids]
    assert len(tokens) == 8
    resent = [
        step.num_scheduled_tokens["crosses"]
        for step in executor.steps
        for new in step.new_requests
        if new.request_id == "crosses"
    ]
    assert resent == [8, 11]  # again at 11 tokens (the prompt, the 3 outputs past 10): all recomputed
    assert core.scheduler.num_preemptions == 0  # a switch, not a shortage of blocks
    # the crossing request's long blocks serve a long request with its tokens
    add(core, "long", prompt + tokens[:4], max_tokens=2)
    run_to_completion(core)
    core, executor = make_core(rope_switch_len=10, async_scheduling=async_scheduling)
    add(core, "short", prompt, max_tokens=1)
    run_to_completion(core)
    add(core, "long again", prompt + [1, 2, 3, 4], max_tokens=1)  # 12 tokens: long from the start
    add(core, "short again", prompt, max_tokens=1)
    run_to_completion(core)
    computed = {
        new.request_id: new.num_computed_tokens for step in executor.steps for new in step.new_requests
    }
    assert computed == {"short": 0, "long again": 0, "short again": 4}  # short blocks never serve a long one
