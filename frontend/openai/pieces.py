"""A chat run's outputs as its plan reads them: what each engine output added to a choice's content,
reasoning and tool calls, and the finish reason the plan gives it. The doors that are not chat
completions (responses, messages) format these; chat completions formats the same parse in chat.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from frontend.engine.output_processor import Choice, Delta, RequestState
from frontend.openai.chat import ChatRun
from frontend.parsers.base import Delta as ParsedDelta
from frontend.parsers.base import Parsed, StreamingParse


@dataclass
class Piece:
    """What one engine output added to one choice."""

    state: RequestState
    delta: Delta  # as the output processor gave it (text, token ids, logprobs)
    parsed: ParsedDelta  # new content, reasoning and call pieces
    finish_reason: str | None  # the plan's: "tool_calls" where a call ended the choice


async def pieces(
    run: ChatRun, stream: AsyncGenerator[tuple[RequestState, Delta], None]
) -> AsyncIterator[Piece]:
    parses: dict[int, StreamingParse] = {}
    async for state, delta in stream:
        finish_reason = delta.finish_reason
        if not run.plan.parses:
            parsed = ParsedDelta(content=delta.text)
        else:
            parse = parses.setdefault(delta.index, StreamingParse(run.plan.parse))
            parsed = parse.update(state.choices[delta.index].text, finish_reason is not None)
            if finish_reason is not None:
                finish_reason = run.plan.finish_reason(parse.result, finish_reason)
        yield Piece(state, delta, parsed, finish_reason)


def parsed_choice(run: ChatRun, choice: Choice) -> tuple[Parsed, str | None]:
    """A finished choice's content, reasoning and calls, and its finish reason."""
    if not run.plan.parses:
        return Parsed(content=choice.text), choice.finish_reason
    parsed = run.plan.parse(choice.text, final=True)
    return parsed, run.plan.finish_reason(parsed, choice.finish_reason)
