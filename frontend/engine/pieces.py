"""A choice's text read as pieces (content, reasoning, tool-call fragments) and the finish reason the
reading gives: made once in the output path, so that every door (chat, responses, messages, batch)
formats the same pieces in its own shape.

A request's `TextParser` (its door's plan: the tool-call and reasoning parsers it chose) reads the
choice's whole text so far; `StreamingParse` turns each reading into what is new. One rule is added
here, for every door: content that is only whitespace where no text is open yet (at the start, after
reasoning, after a call) waits until it is known to be text. It goes out with the next text; a call
that starts drops it; at the end it goes out only if no call came. So a stream's pieces build what the
non-streamed answer holds: no text item made of the newlines around a call.

Invariants: without a parser, the pieces' content is the choice's text, delta by delta; with one, the
pieces' calls and reasoning concatenate to the final reading's, and their content to its content less
the whitespace that waited in vain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from frontend.parsers.base import Delta as Pieces  # re-exported: a Delta's pieces
from frontend.parsers.base import Parsed, StreamingParse

__all__ = ["Block", "ChoicePieces", "InOrder", "PieceFormatter", "Pieces", "TextParser", "formatted"]


class TextParser(Protocol):
    """How a door's plan reads a choice's text (frontend/openai/tools.py's ChatPlan)."""

    def parse(self, text: str, final: bool) -> Parsed: ...

    def finish_reason(self, parsed: Parsed, reason: str | None) -> str | None: ...


class PieceFormatter(Protocol):
    """A door's streamed shape (Anthropic's content blocks, Responses' items): the frames each piece adds."""

    def reasoning(self, text: str) -> list[bytes]: ...

    def content(self, text: str) -> list[bytes]: ...

    def call(self, call_id: str | None, name: str | None, arguments: str) -> list[bytes]: ...


def formatted(pieces: Pieces, formatter: PieceFormatter) -> list[bytes]:
    """One delta's pieces through a door's formatter, in the order the whitespace rule reads them:
    reasoning, then content, then each call's fragment (its id and name on its first)."""
    frames = formatter.reasoning(pieces.reasoning) if pieces.reasoning else []
    if pieces.content:
        frames += formatter.content(pieces.content)
    for call in pieces.calls:
        frames += formatter.call(call.id, call.name, call.arguments)
    return frames


@dataclass
class Block:
    """A run of one kind of piece in an answer: "reasoning", "text", or one "call" (its arguments)."""

    kind: str
    text: str
    call_id: str | None = None
    name: str | None = None


class InOrder:
    """A formatter that keeps the blocks its pieces build, in the order they came: what a door whose
    answer lists blocks (Anthropic's content, Responses' output items) shows, streamed or not. Text after
    a call is a block of its own, as a stream cannot reopen the text it closed."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []

    def _extend(self, kind: str, text: str) -> list[bytes]:
        if self.blocks and self.blocks[-1].kind == kind:
            self.blocks[-1].text += text
        else:
            self.blocks.append(Block(kind, text))
        return []

    def reasoning(self, text: str) -> list[bytes]:
        return self._extend("reasoning", text)

    def content(self, text: str) -> list[bytes]:
        return self._extend("text", text)

    def call(self, call_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        calls = [block for block in self.blocks if block.kind == "call"]
        if call_id is not None or not calls:
            self.blocks.append(Block("call", arguments, call_id, name))
        else:  # the open call's next fragment
            calls[-1].text += arguments
        return []


class ChoicePieces:
    """One choice's reading. incremental False (a request that is not streamed): the text is read once,
    when the choice ends, rather than on every delta (a reading is linear in the text so far)."""

    def __init__(self, parser: TextParser | None, incremental: bool = True) -> None:
        self.parser = parser
        self.incremental = incremental
        self.parse = StreamingParse(parser.parse) if parser is not None else None
        self.text = ""
        self.finish_reason: str | None = None  # the reported one: "tool_calls" where calls ended it
        self.pending = ""  # whitespace content that waits to be known as text
        self.in_text = False  # text is open: whitespace goes out at once
        self.num_calls = 0
        # the blocks, in the order the readings found them: incremental readings keep text after a call
        # apart; one reading at the end lists its reasoning, its content, then its calls
        self.in_order = InOrder()

    def update(self, text: str, new_text: str, finish_reason: str | None) -> Pieces:
        """text: the choice's text so far; new_text: what this delta added; finish_reason: the engine's
        (or the stop string's), when this delta ends the choice."""
        self.text = text
        final = finish_reason is not None
        if self.parse is None:
            self.finish_reason = finish_reason
            pieces = Pieces(content=new_text)
        elif not (self.incremental or final):
            return Pieces()
        else:
            assert self.parser is not None
            pieces = self.parse.update(text, final)
            if final:
                self.finish_reason = self.parser.finish_reason(self.parse.result, finish_reason)
            pieces = self._whitespace_waits(pieces, final)
        formatted(pieces, self.in_order)
        return pieces

    @property
    def blocks(self) -> list[Block]:
        """The answer's blocks in order (reasoning, text, calls as they came; see `in_order`)."""
        return self.in_order.blocks

    @property
    def result(self) -> Parsed:
        """The reading of the text so far (the whole answer, once the choice ended)."""
        return Parsed(content=self.text) if self.parse is None else self.parse.result

    def _whitespace_waits(self, pieces: Pieces, final: bool) -> Pieces:
        # in the order every door formats a delta (`formatted`): reasoning, then content, then calls
        if pieces.reasoning:
            self.in_text = False
        if pieces.content and not self.in_text:
            self.pending += pieces.content
            pieces.content = ""
            if self.pending.strip():
                pieces.content, self.pending, self.in_text = self.pending, "", True
        started = sum(1 for call in pieces.calls if call.id is not None)
        if started:
            self.pending, self.in_text, self.num_calls = "", False, self.num_calls + started
        if final and self.pending and self.num_calls == 0:
            pieces.content, self.pending = pieces.content + self.pending, ""
        return pieces
