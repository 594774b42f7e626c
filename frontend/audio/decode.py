"""An uploaded audio file's bytes -> float32 mono samples at the model's rate (16 kHz for Whisper).

Two decoders, one per family of formats, so that each format has one tested path:
- libsndfile (soundfile) for WAV, FLAC and Ogg (Vorbis, Opus, FLAC in Ogg), read in blocks of about 1 s;
- FFmpeg (PyAV) for everything else it opens (MP3, M4A/MP4 with AAC, WebM/Matroska with Opus, ...),
  decoded packet by packet.
Both (codecs.py, imported by the first decode) feed one `Resampler`: the channels are averaged (librosa's and vLLM's downmix; FFmpeg's own mono
matrix weighs each side of a stereo pair by 1/sqrt(2), which can leave [-1, 1]), then FFmpeg's swresample
converts the rate.

Invariants:
- The limits are checked as the samples arrive, never after the whole file is decoded: what is held is at
  most a limit's worth of output plus one block or packet. A header's claimed length or rate is never
  trusted (vLLM's #49948: a forged 655 kHz sample rate slipped 11.7 GiB of PCM past a header check).
- A file that fails to decode raises `InvalidAudioError` and one past a limit `AudioTooLargeError`, both
  ValueErrors for the HTTP edge to map to a 400; no other exception type escapes but MemoryError.
"""

from __future__ import annotations

from frontend.audio.limits import (
    WHISPER_SAMPLE_RATE,
    AudioLimits,
    AudioTooLargeError,
    InvalidAudioError,
    Samples,
)


def decode_audio(data: bytes, limits: AudioLimits, sample_rate: int = WHISPER_SAMPLE_RATE) -> Samples:
    """The upload -> float32 mono samples at `sample_rate`, never empty. The file size is checked before
    anything is decoded, the duration and the decoded bytes while decoding. Synchronous: run it in a
    thread (libsndfile and FFmpeg keep no shared state here; concurrent decodes give identical results)."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if len(data) > limits.max_file_bytes:
        raise AudioTooLargeError("max_file_bytes", len(data), limits.max_file_bytes)
    if not data:
        raise InvalidAudioError("the file is empty")
    # NOTE: imported here: PyAV and libsndfile are ~0.1 s of every API server's start, and a text model's
    # server never decodes audio
    from frontend.audio.codecs import Resampler, describe, read_with_pyav, read_with_soundfile

    resampler = Resampler(limits, sample_rate)
    try:
        if not read_with_soundfile(data, resampler):
            read_with_pyav(data, resampler)
        return resampler.finish()
    except (InvalidAudioError, AudioTooLargeError, MemoryError):
        raise
    except Exception as error:  # whatever a decoder raises on these bytes is the file's fault
        raise InvalidAudioError(f"it could not be decoded ({describe(error)})") from error
