"""Pooling requests in the engine, against the fake executor: prefill only, finished by their pooled
value; an encoder's input never chunked, its prefix never cached; the runner and the request must agree."""

from __future__ import annotations

import struct

import pytest

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest
from protocol.pooling import PoolingParams
from protocol.sampling import SamplingParams
from tests.fake_executor import FakeExecutor


def make_core(pooling: str, **kwargs) -> tuple[EngineCore, FakeExecutor]:  # type: ignore[no-untyped-def]
    executor = FakeExecutor(num_kv_blocks=64, block_size=4, max_model_len=64, pooling=pooling)
    config = EngineConfig(worker=WorkerConfig(model="fake"), **kwargs)
    return EngineCore(config, executor), executor


def add(core: EngineCore, request_id: str, prompt: list[int], task: str = "embed") -> None:
    core.add_request(
        AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1),
            arrival_time=0.0,
            pooling_params=PoolingParams(task=task),
        )
    )


def run(core: EngineCore) -> dict[str, list]:  # type: ignore[type-arg]
    outputs: dict[str, list] = {}  # type: ignore[type-arg]
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        for _, output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.scheduler.check_invariants()
    assert not core.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pooling_request_is_prefill_only_and_ends_with_its_value(async_scheduling: bool) -> None:
    core, executor = make_core("LAST", long_prefill_token_threshold=16, async_scheduling=async_scheduling)
    add(core, "a", list(range(3, 40)))  # 37 tokens: three chunks of 16 at most
    add(core, "b", [5, 6, 7])
    outputs = run(core)
    for request_id, length in (("a", 37), ("b", 3)):
        (last,) = outputs[request_id]  # one output: the value, no token
        assert last.finish_reason == "stop" and last.new_token_ids == []
        assert struct.unpack("<2f", last.pooled.data) == (float(length), 1.0) and last.pooled.shape == [2]
    chunks = [step.num_scheduled_tokens["a"] for step in executor.steps if "a" in step.num_scheduled_tokens]
    assert chunks == [16, 16, 5]
    assert core.scheduler.kv_cache.usage == 0.0  # every block back


def test_an_encoder_input_runs_whole_in_one_step_and_skips_the_prefix_cache() -> None:
    core, executor = make_core("encoder", max_num_seqs=1, long_prefill_token_threshold=8)
    assert not core.model_info.enable_prefix_caching
    assert core.scheduler_config.max_num_batched_tokens == 2048  # a pooling step's least
    add(core, "a", list(range(3, 50)))  # 47 tokens
    add(core, "b", list(range(3, 50)))
    outputs = run(core)
    assert {r: o[-1].finish_reason for r, o in outputs.items()} == {"a": "stop", "b": "stop"}
    scheduled = [count for step in executor.steps for count in step.num_scheduled_tokens.values()]
    assert scheduled == [47, 47]  # never a chunk, whatever the threshold says
    assert all(o[-1].num_cached_tokens == 0 for o in outputs.values())


def test_the_prefix_cache_serves_last_pooling_only() -> None:
    last, _ = make_core("LAST")
    mean, _ = make_core("MEAN")
    assert last.model_info.enable_prefix_caching and not mean.model_info.enable_prefix_caching


def test_runner_and_request_must_agree() -> None:
    core, _ = make_core("LAST")
    with pytest.raises(InvalidParameterError, match="pooling model"):
        core.add_request(
            AddRequest(
                request_id="g", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), arrival_time=0.0
            )
        )
    with pytest.raises(InvalidParameterError, match="does not serve 'classify'"):
        add(core, "c", [1, 2], task="classify")
    generate = EngineCore(EngineConfig(worker=WorkerConfig(model="fake")), FakeExecutor())
    with pytest.raises(InvalidParameterError, match="generative model"):
        add(generate, "e", [1, 2])


def test_a_pooling_prompt_may_fill_max_model_len() -> None:
    core, _ = make_core("LAST")
    add(core, "full", list(range(3, 67)))  # 64 tokens: max_model_len, no output token to fit
    assert run(core)["full"][-1].finish_reason == "stop"
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        add(core, "over", list(range(3, 68)))


def test_token_types_are_an_encoders_and_inside_the_prompt() -> None:
    core, _ = make_core("encoder")
    for start in (-1, 0, 3):
        with pytest.raises(InvalidParameterError, match="token types"):
            core.add_request(
                AddRequest(
                    request_id=f"t{start}",
                    prompt_token_ids=[1, 2, 3],
                    sampling_params=SamplingParams(max_tokens=1),
                    arrival_time=0.0,
                    pooling_params=PoolingParams(token_type_start=start),
                )
            )


def test_a_pooling_request_in_flight_does_not_shrink_the_prefill_share() -> None:
    core, executor = make_core(
        "LAST", decode_prefill_token_budget=8, long_prefill_token_threshold=16, async_scheduling=True
    )
    add(core, "short", [5, 6, 7])  # done in step 1; its last chunk is in flight while step 2 is scheduled
    add(core, "long", list(range(3, 40)))
    run(core)
    chunks = [
        step.num_scheduled_tokens["long"] for step in executor.steps if "long" in step.num_scheduled_tokens
    ]
    assert chunks == [16, 16, 5]  # not cut to the decoding share of 8: nothing in the batch decodes


def test_dimensions_must_be_a_matryoshka_size() -> None:
    core, _ = make_core("LAST")  # the fake's pooler lists no Matryoshka sizes; hidden_size is 0
    with pytest.raises(InvalidParameterError, match="Matryoshka"):
        core.add_request(
            AddRequest(
                request_id="d",
                prompt_token_ids=[1, 2],
                sampling_params=SamplingParams(max_tokens=1),
                arrival_time=0.0,
                pooling_params=PoolingParams(dimensions=8),
            )
        )
