"""The offline API over real engine and worker processes, on a tiny random Llama (token-id prompts):
bad input gets a typed error naming the parameter and leaves the engine healthy; engine death surfaces
as EngineDeadError instead of a hang, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from frontend import LLM, SamplingParams, StructuredOutputsParams
from protocol.errors import EngineDeadError, InvalidParameterError
from tests.test_correctness_tiny import build_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny("llama", folder)
    return folder


@pytest.fixture(scope="module")
def llm(tiny_folder: str):  # type: ignore[no-untyped-def]
    with LLM(tiny_folder, dtype="float32", max_model_len=128, num_kv_blocks=32) as llm:
        yield llm


def assert_idle(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0, stats
    assert llm.check_invariants()


def test_generates_from_token_ids(llm: LLM) -> None:
    results = llm.generate(
        [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    assert [len(r.outputs[0].token_ids) for r in results] == [5, 5]
    assert all(r.outputs[0].finish_reason == "length" for r in results)
    assert llm.model_info.max_model_len == 128 and llm.model_info.vocab_size == 512


@pytest.mark.parametrize(
    "prompt,params,param_name",
    [
        ([1, 2, 3], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(logprobs=1000), "logprobs"),
        ([1, 2, 3], SamplingParams(max_tokens=500), "max_tokens"),
        ([1, 2, 3], SamplingParams(logit_bias={10_000: 1.0}), "logit_bias"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 100_000], SamplingParams(), "prompt"),  # rejected by the engine: out of vocabulary
    ],
)
def test_bad_input_is_a_typed_error_and_leaves_the_engine_healthy(
    llm: LLM, prompt, params, param_name
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidParameterError) as error:
        llm.generate([prompt], params)
    assert error.value.param == param_name
    assert error.value.message
    assert_idle(llm)
    assert (
        len(llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids)
        == 2
    )


def test_priority_and_many_requests_leave_no_blocks(llm: LLM) -> None:
    prompts = [[i % 500 + 1] * (5 + i % 40) for i in range(40)]
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=20, ignore_eos=True)
    results = llm.generate(prompts, params, priority=[i % 3 for i in range(40)])
    assert all(len(r.outputs[0].token_ids) == 20 for r in results)
    assert_idle(llm)


def test_engine_death_is_an_error_not_a_hang(tiny_folder: str) -> None:
    llm = LLM(tiny_folder, dtype="float32", max_model_len=128, num_kv_blocks=32)
    engine = psutil.Process(llm.engine.pid)
    workers = engine.children()
    assert workers, "the engine should own a worker process"
    os.kill(llm.engine.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=100))
    assert time.monotonic() - started < 30
    llm.shutdown()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"worker processes outlived their engine: {alive}"


@pytest.mark.parametrize("flag, expected", [([], True), (["--no-async-scheduling"], False)])
def test_async_scheduling_flag_reaches_the_engine_config(
    tiny_folder: str, flag: list[str], expected: bool
) -> None:
    from frontend.cli.main import build_parser, engine_args_of

    args = build_parser().parse_args(["serve", tiny_folder, *flag])
    assert engine_args_of(args).engine_config().async_scheduling is expected


def test_structured_outputs_without_a_tokenizer_fail_the_request_not_the_engine(llm: LLM) -> None:
    """The worker cannot build a grammar for a model with no tokenizer: that request ends with a typed
    error, and the engine goes on with no block left behind."""
    spec = StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidParameterError) as caught:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert caught.value.param == "structured_outputs" and "tokenizer" in caught.value.message
    assert (
        len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids)
        == 3
    )
    assert_idle(llm)
