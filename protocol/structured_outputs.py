"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's field names).

Exactly one kind is set. The frontend validates it against the grammar backend before the request is
sent; the worker compiles it into a token matcher that masks the logits of every step.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import InvalidParameterError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """One output constraint. Field order is an ABI: append defaulted fields only."""

    json: str | dict[str, Any] | None = None  # a JSON schema (or its text): the output is one JSON value
    # valid against it
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar: Lark, or GBNF/EBNF (llama.cpp's form)
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None  # serialized {"type": "structural_tag", ...}: free text, with
    # constrained segments that start at trigger strings (tool calls inside ordinary text)
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)
    whitespace_pattern: str | None = None  # JSON: the regex whitespace between tokens must match
    start_after_token_ids: list[int] = []  # unconstrained until the output contains these tokens (the
    # end-of-reasoning marker: the constraint applies to the answer after a model's thinking)

    @property
    def kind(self) -> str:
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        return set_kinds[0] if set_kinds else ""

    def cache_key(self) -> bytes:
        """Equal specs compile to equal grammars: the worker caches compiled matchers by this key."""
        return msgspec.msgpack.encode(msgspec.structs.replace(self, start_after_token_ids=[]))

    def validate(self) -> None:
        """Shape only (one kind, sizes); the grammar backend checks the content."""
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(set_kinds) != 1:
            found = ", ".join(set_kinds) or "none"
            raise InvalidParameterError(
                "structured_outputs",
                f"structured outputs take exactly one of {', '.join(KINDS)}; got {found}.",
            )
        for kind in ("json", "regex", "grammar", "structural_tag", "whitespace_pattern"):
            text = getattr(self, kind)
            if isinstance(text, dict):
                text = msgspec.json.encode(text)
            if text is not None and len(text) > MAX_SPEC_CHARS:
                raise InvalidParameterError(
                    "structured_outputs", f"{kind} is longer than {MAX_SPEC_CHARS} characters."
                )
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(self.choice):
                raise InvalidParameterError(
                    "structured_outputs",
                    f"choice must list 1 to {MAX_CHOICES} non-empty strings.",
                )
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise InvalidParameterError(
                "structured_outputs", "disable_any_whitespace and whitespace_pattern exclude each other."
            )
        if len(self.start_after_token_ids) > 16:
            raise InvalidParameterError("structured_outputs", "start_after_token_ids has at most 16 tokens.")
