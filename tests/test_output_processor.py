"""The one output path, without processes: n fan-out, incremental text with stop strings held back,
logprobs and prompt logprobs, finish reasons, typed engine errors, stale outputs, aborts on a stop."""

from __future__ import annotations

import asyncio

import pytest

from frontend.engine.async_llm import AsyncLLM, final_state
from frontend.engine.output_processor import SHUTDOWN_REASON, OutputProcessor
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.messages import AddRequest, Logprobs, RequestError, RequestOutput
from protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # type: ignore[no-untyped-def]
    return smollm2_tokenizer


def ids_of(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_n_choices_fan_out_into_engine_requests_with_their_own_seeds(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, requests = processor.add_request("r", [1, 2], SamplingParams(n=3, seed=7), cache_salt="tenant")
    assert [r.request_id for r in requests] == ["r-0", "r-1", "r-2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 and r.cache_salt == "tenant" for r in requests)
    assert state.open_child_ids == ["r-0", "r-1", "r-2"]


def test_text_streams_and_a_stop_string_is_held_back_then_cut(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1], SamplingParams(stop=["STOP"], max_tokens=64))
    pieces, deltas = [], []
    for token_id in ids_of(tokenizer, "Paris is nice STOP and more"):
        delta = processor.process(state, RequestOutput("r-0", [token_id]))
        if delta is None:
            break
        deltas.append(delta)
        pieces.append(delta.text)
    assert "".join(pieces) == state.choices[0].text == "Paris is nice "
    assert "STOP" not in "".join(pieces)
    last = deltas[-1]
    assert last.finish_reason == "stop" and last.stop_reason == "STOP" and last.abort
    # The engine's outputs still in flight after the stop change nothing.
    assert processor.process(state, RequestOutput("r-0", [5])) is None
    assert state.finished and state.open_child_ids == []


def test_finish_from_the_engine_and_logprobs_accumulate(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1, 2, 3], SamplingParams(n=2, logprobs=1, prompt_logprobs=1))
    prompt_part = Logprobs([[2, 9], [3, 9]], [[-1.0, -0.5], [-2.0, -0.1]], [2, 2])
    first = processor.process(
        state,
        RequestOutput(
            "r-0", [4], new_logprobs=Logprobs([[4, 4]], [[-0.2, -0.2]], [1]), new_prompt_logprobs=prompt_part
        ),
    )
    assert first is not None and first.prompt_logprobs == prompt_part
    second = processor.process(
        state,
        RequestOutput(
            "r-1", [5], new_logprobs=Logprobs([[5, 4]], [[-0.9, -0.2]], [2]), new_prompt_logprobs=prompt_part
        ),
    )
    assert second is not None and second.prompt_logprobs is None  # choice 0 alone reports them
    done = processor.process(
        state,
        RequestOutput(
            "r-0", [6], "length", new_logprobs=Logprobs([[6, 6]], [[-0.3, -0.3]], [1]), num_cached_tokens=2
        ),
    )
    assert done is not None and done.finish_reason == "length" and not done.abort
    assert state.choices[0].token_ids == [4, 6] and state.choices[0].logprobs.ranks == [1, 1]
    assert state.prompt_logprobs.token_ids == [[2, 9], [3, 9]]
    assert state.num_cached_tokens == 2 and not state.finished
    processor.process(state, RequestOutput("r-1", [2], "stop", stop_reason=2))
    assert state.finished and state.choices[1].stop_reason == 2 and state.num_output_tokens == 4


def test_an_engine_rejection_is_a_typed_error_naming_the_parameter(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1], SamplingParams())
    rejection = RequestOutput("r-0", [], "error", error=RequestError("prompt", "out of vocabulary"))
    with pytest.raises(InvalidParameterError) as error:
        processor.process(state, rejection)
    assert error.value.param == "prompt" and error.value.message == "out of vocabulary"


def test_aborts_a_drain_ends_cleanly_any_other_is_an_engine_failure(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1], SamplingParams())
    delta = processor.process(state, RequestOutput("r-0", [], "abort", stop_reason=SHUTDOWN_REASON))
    assert delta is not None and delta.finish_reason == "abort"
    state, _ = processor.add_request("s", [1], SamplingParams())
    with pytest.raises(EngineDeadError):
        processor.process(state, RequestOutput("s-0", [], "abort"))


def test_outputs_of_other_requests_are_not_folded_in(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1], SamplingParams(n=2))
    assert processor.process(state, RequestOutput("r-2", [1])) is None
    assert processor.process(state, RequestOutput("other-0", [1])) is None
    assert processor.process(state, RequestOutput("r-x", [1])) is None


class ScriptedClient:
    """The engine client's interface, answering each request with a script of outputs (no sockets)."""

    def __init__(self, script: dict[str, list[RequestOutput]]) -> None:
        self.script = script
        self.sent: list[AddRequest] = []
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def add_request(self, request: AddRequest, queue: asyncio.Queue) -> asyncio.Queue:  # type: ignore[type-arg]
        self.sent.append(request)
        for output in self.script[request.request_id]:
            queue.put_nowait(output)
        return queue

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def engine_index(self, request_id: str) -> int:
        return 0


def test_async_llm_aborts_what_a_stop_string_ended_and_what_is_left_open(tokenizer) -> None:  # type: ignore[no-untyped-def]
    words = ids_of(tokenizer, "one two three")
    script = {
        "r-0": [RequestOutput("r-0", [t]) for t in words],  # " three" matches the stop string
        "r-1": [RequestOutput("r-1", [words[0]], "length")],
    }
    client = ScriptedClient(script)
    llm = AsyncLLM(client, tokenizer)  # type: ignore[arg-type]
    state = asyncio.run(final_state(llm.generate("r", [1], SamplingParams(n=2, stop=[" three"]))))
    assert state.choices[0].text == "one two" and state.choices[0].finish_reason == "stop"
    assert state.choices[1].finish_reason == "length"
    assert client.aborted == ["r-0"] and sorted(client.released) == ["r-0", "r-1"]

    async def leave_early() -> None:
        stream = llm.generate("s", [1], SamplingParams(n=2))
        await stream.__anext__()  # the client goes away after the first delta
        await stream.aclose()

    client.script = {"s-0": [RequestOutput("s-0", [words[0]])], "s-1": [RequestOutput("s-1", [words[1]])]}
    client.aborted.clear()
    asyncio.run(leave_early())
    assert sorted(client.aborted) == ["s-0", "s-1"]


def test_metrics_count_each_choice_and_the_request_params_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from frontend.metrics import Metrics
    from protocol.messages import ModelInfo

    registry = CollectorRegistry()
    info = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0")
    processor = OutputProcessor(tokenizer, Metrics(info, registry=registry))
    state, _ = processor.add_request("r", [1, 2], SamplingParams(n=3, max_tokens=2))
    for index in range(3):
        processor.process(state, RequestOutput(f"r-{index}", [5]))
        processor.process(state, RequestOutput(f"r-{index}", [6], "length"))
    labels = {"model_name": "m", "engine": "0"}
    assert (
        registry.get_sample_value("engine:request_success_total", {**labels, "finished_reason": "length"})
        == 3
    )
    assert registry.get_sample_value("engine:generation_tokens_total", labels) == 6
    assert registry.get_sample_value("engine:request_params_n_count", labels) == 1
    assert registry.get_sample_value("engine:request_params_n_sum", labels) == 3
    assert registry.get_sample_value("engine:request_params_max_tokens_count", labels) == 1
