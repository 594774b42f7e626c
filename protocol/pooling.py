"""Pooling requests: what a pooling model returns in place of sampled tokens (embeddings, class logits).

A pooling request is prefill-only: the engine schedules its prompt, the worker pools the hidden states
of its tokens when the last of them is computed, and the request finishes with that value. Vectors
travel as float32 bytes (one msgpack bin), never as a list of Python floats.
"""

from __future__ import annotations

import msgspec

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# what a pooling model does, as vLLM's tasks name it
POOLING_TASKS = ("embed", "classify", "score", "token_embed")


class PoolerConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a pooling model turns its hidden states into one output (--pooler-config, or the model folder's
    sentence-transformers files). None fields: the model's or the conversion's default."""

    pooling_type: str | None = None  # LAST, MEAN, CLS or ALL
    normalize: bool | None = None  # unit length (embeddings)
    dimensions: int | None = None  # keep the first this many (a Matryoshka model's default)
    # Matryoshka models: the output sizes that keep their meaning; [] none but the full size
    matryoshka_dimensions: list[int] = []
    activation: bool | None = None  # classification: softmax over the labels (sigmoid for one label)


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Per-request pooling settings. Field order is an ABI: append defaulted fields only."""

    task: str = "embed"  # one of POOLING_TASKS
    dimensions: int | None = None  # keep the first this many of the vector, then normalize (Matryoshka)
    normalize: bool | None = None  # None: the model's pooler config
    activation: bool | None = None  # classify/score: None: the model's pooler config
    # token index from which the input's token types are 1 (a cross-encoder's second text); None: all 0
    token_type_start: int | None = None


class PooledOutput(msgspec.Struct, array_like=True):
    """One request's pooled value: float32 little-endian, row-major, of `shape`."""

    data: bytes
    shape: list[int]  # [dim] for a vector, [num_tokens, dim] for ALL pooling
