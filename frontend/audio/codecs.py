"""The two decoders of decode.py, with PyAV and libsndfile imported: libsndfile (soundfile) reads WAV,
FLAC and Ogg in blocks of about 1 s, FFmpeg (PyAV) everything else packet by packet, and both feed one
Resampler, which averages the channels, converts the rate with swresample and checks the duration and
decoded-bytes limits as the samples arrive. decode.decode_audio is the entry point."""

from __future__ import annotations

import io

import av
import numpy as np
import soundfile as sf  # type: ignore[import-untyped]

from frontend.audio.limits import (
    FLOAT32_BYTES,
    MIB,
    AudioLimits,
    AudioTooLargeError,
    InvalidAudioError,
    Samples,
)

# libsndfile's share; it also reads MP3 (through mpg123) and a dozen rarer containers, which go to FFmpeg
# so that a format never has two decoders. Only bytes with these first four bytes reach libsndfile: its
# mpg123 prints warnings to stderr on a broken MP3, and what it need not parse cannot hurt it.
SOUNDFILE_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "FLAC", "OGG"})
SOUNDFILE_MAGIC = (b"RIFF", b"RF64", b"fLaC", b"OggS")
# one soundfile read holds at most this much, whatever the channel count
MAX_BLOCK_BYTES = MIB
# swresample sees batches of about this much audio: one PyAV frame per 26 ms MP3 packet costs more in
# Python than the resampling itself; it is also the soundfile block's length
BATCH_S = 1.0
# FFmpeg opens nothing beyond the upload itself: a playlist or concat list inside it may not reach file:,
# http: or data: URLs (the upload's own bytes come through PyAV's IO callbacks, not a protocol)
NO_NESTED_PROTOCOLS = {"protocol_whitelist": "none"}


def read_with_soundfile(data: bytes, resampler: Resampler) -> bool:
    """False, having read nothing, when libsndfile does not open the bytes as one of SOUNDFILE_FORMATS."""
    if not data.startswith(SOUNDFILE_MAGIC):
        return False
    try:
        file = sf.SoundFile(io.BytesIO(data))
    except Exception:  # LibsndfileError, with code 0 when threads race on sf_error (python-soundfile#479)
        return False
    with file:
        if file.format not in SOUNDFILE_FORMATS:
            return False
        rate, channels = int(file.samplerate), int(file.channels)
        if rate <= 0 or channels <= 0:
            raise InvalidAudioError(f"{rate} Hz, {channels} channels")
        block_frames = max(1, min(int(rate * BATCH_S), MAX_BLOCK_BYTES // (FLOAT32_BYTES * channels)))
        while True:
            block = file.read(block_frames, dtype="float32", always_2d=True)  # [frames, channels]
            if len(block) == 0:
                return True
            resampler.add(block.mean(axis=1, dtype=np.float32), rate)  # [frames]


def read_with_pyav(data: bytes, resampler: Resampler) -> None:
    with av.open(io.BytesIO(data), mode="r", container_options=NO_NESTED_PROTOCOLS) as container:
        if not container.streams.audio:
            raise InvalidAudioError("it has no audio stream")
        stream = container.streams.audio[0]
        for frame in container.decode(stream):
            resampler.add(mono_of(frame), frame.sample_rate)


def mono_of(frame: av.AudioFrame) -> Samples:
    """A decoded frame in any sample format -> the mean of its channels as float32."""
    samples = frame.to_ndarray()  # planar: [channels, frames]; packed: [1, frames * channels]
    if not frame.format.is_planar:
        samples = samples.reshape(-1, frame.layout.nb_channels).T  # [channels, frames]
    floats = samples.astype(np.float32)
    if samples.dtype.kind in "iu":  # integer PCM -> [-1, 1)
        half = 2.0 ** (8 * samples.dtype.itemsize - 1)
        floats = (floats - (half if samples.dtype.kind == "u" else 0.0)) / np.float32(half)
    mono: Samples = floats.mean(axis=0, dtype=np.float32)  # [frames]
    return mono


def describe(error: Exception) -> str:
    if isinstance(error, av.FFmpegError) and error.strerror:
        return str(error.strerror)
    if isinstance(error, sf.LibsndfileError):
        return str(error.error_string)
    return type(error).__name__


class Resampler:
    """Mono float32 at the file's rate in, float32 at `sample_rate` out, under the duration and decoded
    bytes limits. Input is batched to about BATCH_S before swresample sees it; a new rate mid-stream (a
    chained Ogg, an MP3 that switches) flushes the old resampler and starts another."""

    def __init__(self, limits: AudioLimits, sample_rate: int) -> None:
        self.max_duration_s = limits.max_duration_s
        self.max_decoded_bytes = limits.decoded_bytes_limit(sample_rate)
        self.sample_rate = sample_rate
        self.duration_s = 0.0  # decoded so far, at the file's rate
        self.num_bytes = 0  # kept so far, at sample_rate
        self.outputs: list[Samples] = []
        self.pending: list[Samples] = []
        self.num_pending = 0
        self.rate = 0
        self.swr: av.AudioResampler | None = None

    def add(self, mono: Samples, rate: int) -> None:
        if len(mono) == 0:
            return
        if rate <= 0:
            raise InvalidAudioError(f"a sample rate of {rate} Hz")
        if not np.isfinite(mono).all():
            raise InvalidAudioError("samples that are not finite numbers")
        self.duration_s += len(mono) / rate
        if self.duration_s > self.max_duration_s:
            raise AudioTooLargeError("max_duration_s", self.duration_s, self.max_duration_s)
        if rate != self.rate:
            self._flush(final=True)
            self.rate = rate
            self.swr = av.AudioResampler(format="flt", layout="mono", rate=self.sample_rate)
        self.pending.append(mono)
        self.num_pending += len(mono)
        if self.num_pending >= BATCH_S * rate:
            self._flush(final=False)

    def finish(self) -> Samples:
        self._flush(final=True)
        if sum(len(out) for out in self.outputs) == 0:
            raise InvalidAudioError("it holds no audio samples")
        return np.concatenate(self.outputs)

    def _flush(self, final: bool) -> None:
        if self.swr is None:
            return
        frames = []
        if self.pending:
            batch = np.concatenate(self.pending)[None, :]  # [1, num_pending]: packed mono
            self.pending, self.num_pending = [], 0
            frame = av.AudioFrame.from_ndarray(batch, format="flt", layout="mono")
            frame.sample_rate = self.rate
            frames += self.swr.resample(frame)
        if final:
            frames += self.swr.resample(None)
            self.swr = None
        for out in frames:
            samples: Samples = out.to_ndarray()[0]  # [frames]
            self.num_bytes += samples.nbytes
            if self.num_bytes > self.max_decoded_bytes:
                raise AudioTooLargeError("max_decoded_bytes", self.num_bytes, self.max_decoded_bytes)
            self.outputs.append(samples)
