"""The limits an uploaded audio file is decoded under (vLLM's environment variables), and the two errors a
decode raises: `InvalidAudioError` for a file that is not audio we can read, `AudioTooLargeError` for one
past a limit. decode.py and codecs.py share them; neither imports PyAV or libsndfile here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from frontend.config.flags import ConfigError, env_number

MIB = 1024**2
WHISPER_SAMPLE_RATE = 16_000
FLOAT32_BYTES = 4
# First name wins. vLLM's come from vllm/envs.py: VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25), and, since its
# decompression-bomb fixes (#44970, #49948), VLLM_MAX_AUDIO_DECODE_DURATION_S (600) and
# VLLM_MAX_AUDIO_DECODE_BYTES (256 MiB, in bytes).
FILE_SIZE_ENV = ("ENGINE_MAX_AUDIO_CLIP_FILESIZE_MB", "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB")
DURATION_ENV = ("ENGINE_MAX_AUDIO_DECODE_DURATION_S", "VLLM_MAX_AUDIO_DECODE_DURATION_S")
DECODED_BYTES_ENV = ("ENGINE_MAX_AUDIO_DECODE_BYTES", "VLLM_MAX_AUDIO_DECODE_BYTES")
Samples = npt.NDArray[np.float32]


class InvalidAudioError(ValueError):
    """The upload is not audio that we can decode (corrupt, truncated, empty, another kind of file, no
    samples). The message is vLLM's ("Invalid or unsupported audio file"), then the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"Invalid or unsupported audio file: {reason}")
        self.reason = reason


class AudioTooLargeError(ValueError):
    """The upload is past one of `AudioLimits`: `limit` is the field's name, `value` and `maximum` are in
    its unit. vLLM answers 400 for all three (its "Maximum file size exceeded" is a VLLMValidationError
    with param audio_filesize_mb, sent as a BadRequestError); a door that prefers 413 for the file size
    can key on `limit == "max_file_bytes"`."""

    def __init__(self, limit: str, value: float, maximum: float) -> None:
        if limit == "max_file_bytes":
            message = (
                f"Maximum file size exceeded: {value / MIB:.1f} MB, the limit is {maximum / MIB:g} MB "
                f"({FILE_SIZE_ENV[0]})"
            )
        elif limit == "max_duration_s":
            message = (
                f"Audio exceeds the maximum duration of {maximum:g} s: stopped decoding at {value:.1f} s "
                f"({DURATION_ENV[0]})"
            )
        else:
            message = (
                f"Decoded audio exceeds the maximum of {maximum:g} bytes: stopped decoding at {value:g} "
                f"({DECODED_BYTES_ENV[0]})"
            )
        super().__init__(message)
        self.limit = limit
        self.value = value
        self.maximum = maximum


@dataclass(frozen=True)
class AudioLimits:
    """What one upload may cost; `from_env` reads the ENGINE_ names, or vLLM's (see FILE_SIZE_ENV)."""

    max_file_bytes: int = 25 * MIB
    """The upload's size; vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB=25, whose MB are MiB (len / 1024**2)."""

    max_duration_s: float = 1800.0
    """The decoded duration. NOTE: 30 min rather than vLLM's 600 s so that what fits in 25 MB fits here
    too: a 128 kbit/s MP3 of 25 MB plays 27 min (60 Whisper chunks, 115 MB of 16 kHz float32)."""

    max_decoded_bytes: int | None = None
    """float32 samples kept after resampling. None: the duration limit's worth at the decode's rate
    (115 MB at 16 kHz), plus 1 s for the resampler's rounding, so the duration is the one limit that
    bites. vLLM's VLLM_MAX_AUDIO_DECODE_BYTES bounds the PCM at the file's own rate and channel count
    instead; here that PCM lives one block at a time and only the 16 kHz mono output accumulates."""

    def __post_init__(self) -> None:
        if self.max_file_bytes <= 0:
            raise ConfigError("max_file_bytes", f"must be positive, got {self.max_file_bytes}")
        if not (math.isfinite(self.max_duration_s) and self.max_duration_s > 0):
            raise ConfigError("max_duration_s", f"must be positive, got {self.max_duration_s}")
        if self.max_decoded_bytes is not None and self.max_decoded_bytes <= 0:
            raise ConfigError("max_decoded_bytes", f"must be positive, got {self.max_decoded_bytes}")

    def decoded_bytes_limit(self, sample_rate: int) -> int:
        if self.max_decoded_bytes is not None:
            return self.max_decoded_bytes
        return math.ceil((self.max_duration_s + 1.0) * sample_rate) * FLOAT32_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AudioLimits:
        """Each limit from its ENGINE_ variable, else vLLM's, else the default. A limit cannot be turned
        off (vLLM's loaders take 0 as no limit): an unbounded decode is the denial of service these guard;
        set a large number instead."""
        file_mb = env_number(environ, FILE_SIZE_ENV)
        duration_s = env_number(environ, DURATION_ENV)
        decoded_bytes = env_number(environ, DECODED_BYTES_ENV)
        return cls(
            max_file_bytes=cls.max_file_bytes if file_mb is None else int(file_mb * MIB),
            max_duration_s=cls.max_duration_s if duration_s is None else duration_s,
            max_decoded_bytes=None if decoded_bytes is None else int(decoded_bytes),
        )
