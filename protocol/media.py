"""An encoder's input as it travels to the worker: a Whisper request's log-mel features.

The frontend computes them with the model's own processor (transformers' WhisperFeatureExtractor), so the
engine and worker see numbers only. The bytes travel inside the msgpack body (one copy of ~1 MB for a 30 s
window of 80 bins); `content_hash` keys the request's prefix-cache blocks apart from another audio's.
"""

from __future__ import annotations

import msgspec


class EncoderInput(msgspec.Struct, array_like=True):
    """One encoder input: a [num_mel_bins, num_frames] float32 array, row-major, little-endian."""

    data: bytes  # the array's bytes
    shape: list[int]  # [num_mel_bins, num_frames]
    content_hash: str  # a digest of `data`: part of every prefix-cache key of the request
    num_tokens: int = 0  # the encoder's output positions (Whisper: num_frames // 2): its share of the budget


class TensorData(msgspec.Struct, array_like=True):
    """One array of a processor's output: row-major, little-endian bytes."""

    data: bytes
    shape: list[int]
    dtype: str  # a numpy dtype name: "float32", "int64", "bool"


class MultiModalInput(msgspec.Struct, array_like=True):
    """One image of a prompt, processed by the model's own processor in the frontend: the vision tower's
    inputs, and the prompt span its embeddings fill.

    The span [offset, offset + length) holds the image's placeholder tokens (ModelInfo.image_token_id), one
    per embedding (num_embeds of them, in order), and may hold markers between them (a row's end, an image's
    start and end) that stay text tokens. `content_hash` keys the KV blocks the span touches apart from those
    of another image (a caller's `uuid` stands in for it where given)."""

    modality: str  # "image"
    tensors: dict[str, TensorData]  # e.g. pixel_values [1, 3, H, W]; a family's extras (image_sizes, ...)
    content_hash: str
    offset: int
    length: int
    num_embeds: int  # the tower's output rows: the encoder budget's share of this image
