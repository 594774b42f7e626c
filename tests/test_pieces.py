"""A choice's text read as pieces in the output path (frontend/engine/pieces.py), without processes: the
pieces of a stream build the non-streamed reading, whitespace around calls waits and is dropped, text
after a call carries its newline, a choice read once at its end gives the same answer, and the
OutputProcessor hands each Delta its pieces with the reported finish reason."""

from __future__ import annotations

import json
import random

import pytest

from frontend.engine.output_processor import OutputProcessor
from frontend.engine.pieces import ChoicePieces
from frontend.openai.tools import ChatPlan
from frontend.parsers.hermes import HermesToolParser
from frontend.parsers.reasoning import DeepSeekR1ReasoningParser
from protocol.messages import RequestOutput
from protocol.sampling import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def plan(reasoning: bool = False) -> ChatPlan:
    parser = DeepSeekR1ReasoningParser(thinking=True) if reasoning else None
    return ChatPlan(TOOLS, "auto", None, HermesToolParser(TOOLS), parser)


def streamed(text: str, parser: ChatPlan | None, seed: int) -> tuple[dict[str, object], str | None]:
    """The pieces of `text` fed in random chunks, concatenated: content, reasoning, calls."""
    rng, pieces, i = random.Random(seed), ChoicePieces(parser), 0
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    while i < len(text):
        step = rng.randint(1, 6)
        final = i + step >= len(text)
        delta = pieces.update(text[: i + step], text[i : i + step], "stop" if final else None)
        i += step
        content, reasoning = content + delta.content, reasoning + delta.reasoning
        for call in delta.calls:
            if call.id is not None:
                calls[call.index] = [call.name or "", ""]
            calls[call.index][1] += call.arguments
    return {"content": content, "reasoning": reasoning, "calls": calls}, pieces.finish_reason


@pytest.mark.parametrize("seed", range(5))
def test_whitespace_around_calls_waits_and_is_dropped(seed: int) -> None:
    got, finish = streamed(f"\n\n{CALL}\n{CALL}\n", plan(), seed)
    arguments = json.dumps({"city": "Paris"})
    assert got == {
        "content": "",
        "reasoning": "",
        "calls": {0: ["get_weather", arguments], 1: ["get_weather", arguments]},
    }
    assert finish == "tool_calls"


@pytest.mark.parametrize("seed", range(5))
def test_text_after_a_call_keeps_its_newline_and_text_before_it_stays(seed: int) -> None:
    got, finish = streamed(f"Let me look.\n{CALL}\nIt is sunny.", plan(), seed)
    assert got["content"] == "Let me look.\n\nIt is sunny." and len(got["calls"]) == 1  # type: ignore[arg-type]
    assert finish == "tool_calls"


def test_whitespace_alone_goes_out_at_the_end_and_reasoning_opens_no_text() -> None:
    got, finish = streamed("  \n ", plan(), 0)
    assert got["content"] == "  \n " and finish == "stop"
    got, _ = streamed("thinking it over</think>\n\nParis.", plan(reasoning=True), 1)
    assert got["reasoning"] == "thinking it over" and got["content"].strip() == "Paris."  # type: ignore[union-attr]


def test_without_a_parser_every_delta_is_content_as_it_came() -> None:
    pieces = ChoicePieces(None)
    assert pieces.update("\n", "\n", None).content == "\n"  # no parser: nothing waits
    assert pieces.update("\nHi", "Hi", "length").content == "Hi"
    assert pieces.finish_reason == "length" and pieces.result.content == "\nHi"


def test_a_choice_read_once_at_its_end_gives_the_streamed_answer() -> None:
    text = f"Sure.\n{CALL}"
    once = ChoicePieces(plan(), incremental=False)
    assert not once.update(text[:10], text[:10], None)  # nothing is read before the end
    final = once.update(text, text[10:], "stop")
    assert final.content == "Sure.\n" and [c.name for c in final.calls] == ["get_weather"]
    assert once.finish_reason == "tool_calls"
    assert once.result.content == plan().parse(text, final=True).content


def test_the_output_processor_hands_each_delta_its_pieces(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer = smollm2_tokenizer
    processor = OutputProcessor(tokenizer)
    state, _ = processor.add_request("r", [1], SamplingParams(max_tokens=200), parser=plan())
    token_ids = list(tokenizer(f"\n{CALL}", add_special_tokens=False)["input_ids"])
    deltas = [processor.process(state, RequestOutput("r-0", [t])) for t in token_ids[:-1]]
    deltas.append(processor.process(state, RequestOutput("r-0", token_ids[-1:], "stop")))
    assert all(d is not None for d in deltas)
    assert "".join(d.pieces.content for d in deltas if d) == ""  # the newline before the call waited
    assert "".join(d.text for d in deltas if d) == f"\n{CALL}"  # the text itself is all there
    last = deltas[-1]
    assert last is not None and last.finish_reason == "tool_calls"
    choice = state.choices[0]
    assert choice.finish_reason == "stop" and choice.reported_finish_reason == "tool_calls"
    assert [call.name for call in choice.parsed.calls] == ["get_weather"]
