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
