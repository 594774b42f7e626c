"""The contract of a grammar backend: validate a spec without a tokenizer, compile it with one, and match
tokens. A second library (xgrammar) is one more subclass in the registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from protocol.structured_outputs import StructuredOutputsParams


class GrammarCompileError(ValueError):
    """The spec passed validation but the backend could not build a matcher for this tokenizer."""


class Matcher(ABC):
    """One request's position in its grammar. Not thread-safe: one caller at a time."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """bitmask: [B, ceil(vocab / 32)] int32; bit t of row `row` set iff token t may come next."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and `error` set) if the grammar rejects it."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing may follow but EOS."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher failed, or an empty string."""


class Backend(ABC):
    """Compiles specs into matchers for one tokenizer; compiled grammars are cached by the caller."""

    name: str

    @staticmethod
    @abstractmethod
    def validate(spec: StructuredOutputsParams) -> None:
        """Raise InvalidParameterError (param "structured_outputs") for a spec this backend cannot enforce
        exactly: bad syntax, or a schema keyword it does not implement. Needs no tokenizer."""

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> Matcher:
        """A fresh matcher at the start of the grammar; raises GrammarCompileError. May run on any thread."""

    @abstractmethod
    def copy(self, matcher: Matcher) -> Matcher:
        """An independent matcher in the same state (a cached compiled grammar, reused per request)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32
