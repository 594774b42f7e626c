"""frontend/audio without a model: every format we take (made here with soundfile and PyAV's encoders)
decodes to 16 kHz mono float32 of the right length and pitch; bad bytes are an InvalidAudioError and
nothing else; the limits stop a decode early; long audio is cut at its quiet moments."""

from __future__ import annotations

import io
import pathlib
from collections.abc import Callable

import av
import numpy as np
import pytest
import soundfile as sf  # type: ignore[import-untyped]

from frontend.audio import (
    AudioLimits,
    AudioTooLargeError,
    InvalidAudioError,
    chunk_bounds,
    decode_audio,
    split_audio,
)
from frontend.config.flags import ConfigError

RATE = 16_000
PITCH_HZ = 440.0
SECONDS = 3.0
LIMITS = AudioLimits()


def tone(rate: int, channels: int, seconds: float = SECONDS, amplitude: float = 0.5) -> np.ndarray:
    """A PITCH_HZ sine in every channel: [channels, frames] float32."""
    t = np.arange(int(rate * seconds)) / rate
    wave = (amplitude * np.sin(2 * np.pi * PITCH_HZ * t)).astype(np.float32)
    return np.tile(wave, (channels, 1))


def with_soundfile(file_format: str, subtype: str) -> Callable[[np.ndarray, int], bytes]:
    def encode(samples: np.ndarray, rate: int) -> bytes:
        buffer = io.BytesIO()
        sf.write(buffer, samples.T, rate, format=file_format, subtype=subtype)
        return buffer.getvalue()

    return encode


def with_pyav(container_format: str, codec: str) -> Callable[[np.ndarray, int], bytes]:
    def encode(samples: np.ndarray, rate: int) -> bytes:
        try:
            av.Codec(codec, "w")
        except Exception:
            pytest.skip(f"this PyAV has no {codec} encoder")
        layout = "stereo" if len(samples) == 2 else "mono"
        buffer = io.BytesIO()
        with av.open(buffer, "w", format=container_format) as container:
            stream = container.add_stream(codec, rate=rate, layout=layout)
            assert isinstance(stream, av.AudioStream)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
            frame.sample_rate, frame.pts = rate, 0
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                container.mux(packet)
        return buffer.getvalue()

    return encode


ENCODERS = {
    "wav": with_soundfile("WAV", "PCM_16"),
    "flac": with_soundfile("FLAC", "PCM_16"),
    "ogg": with_soundfile("OGG", "VORBIS"),
    "mp3": with_pyav("mp3", "libmp3lame"),
    "m4a": with_pyav("ipod", "aac"),
    "webm": with_pyav("webm", "libopus"),
}
# (format, rate, channels): each format at rates its codec takes (Opus has no 44.1 kHz), mono and stereo
CASES = [
    ("wav", 44_100, 2),
    ("wav", 8_000, 1),
    ("flac", 48_000, 2),
    ("flac", 8_000, 1),
    ("ogg", 44_100, 1),
    ("ogg", 48_000, 2),
    ("mp3", 44_100, 2),
    ("mp3", 8_000, 1),
    ("m4a", 48_000, 2),
    ("m4a", 44_100, 1),
    ("webm", 48_000, 2),
    ("webm", 8_000, 1),
]


def peak_hz(samples: np.ndarray, rate: int = RATE) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum)) * rate / len(samples)


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


@pytest.mark.parametrize(("name", "rate", "channels"), CASES)
def test_each_format_decodes_to_16khz_mono_float32_of_the_right_length_and_pitch(
    name: str, rate: int, channels: int
) -> None:
    data = ENCODERS[name](tone(rate, channels), rate)
    samples = decode_audio(data, LIMITS)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert len(samples) / RATE == pytest.approx(SECONDS, rel=0.01)
    assert peak_hz(samples) == pytest.approx(PITCH_HZ, abs=2.0)
    assert rms(samples) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)  # a codec's loss, not a scale


def test_lossless_input_keeps_its_level_and_channels_are_averaged() -> None:
    stereo = tone(44_100, 2)
    stereo[1] = 0.0  # the tone on the left only: the mean of the two halves it
    both = decode_audio(ENCODERS["wav"](tone(44_100, 2), 44_100), LIMITS)
    left = decode_audio(ENCODERS["wav"](stereo, 44_100), LIMITS)
    assert rms(both) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)
    assert rms(left) == pytest.approx(rms(both) / 2, rel=0.01)
    # already at 16 kHz: the same samples back, to the 16-bit quantisation
    same = tone(RATE, 1)[0]
    assert np.abs(decode_audio(ENCODERS["wav"](same[None], RATE), LIMITS) - same).max() < 1e-3


def test_wav_flac_ogg_go_to_libsndfile_and_the_rest_to_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[str] = []
    from frontend.audio import codecs

    read_with_soundfile = codecs.read_with_soundfile

    def spy(data: bytes, resampler: codecs.Resampler) -> bool:
        took = read_with_soundfile(data, resampler)
        used.append("soundfile" if took else "pyav")
        return took

    monkeypatch.setattr(codecs, "read_with_soundfile", spy)
    for name in ENCODERS:
        decode_audio(ENCODERS[name](tone(48_000, 1), 48_000), LIMITS)
    assert used == ["soundfile"] * 3 + ["pyav"] * 3


def wav_of(samples: np.ndarray, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, 8_000, format="WAV", subtype=subtype)
    return buffer.getvalue()


BAD_INPUTS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "text": lambda: b"This is not audio, only a line of text.\n" * 40,
    "random": lambda: np.random.default_rng(0).bytes(4096),
    "wav header only": lambda: ENCODERS["wav"](tone(8_000, 1), 8_000)[:40],
    "mp3 header only": lambda: ENCODERS["mp3"](tone(8_000, 1), 8_000)[:40],
    "zero-length wav": lambda: wav_of(np.zeros(0, np.float32)),
    "nan samples": lambda: wav_of(np.array([0.0, np.nan, 0.5], np.float32), subtype="FLOAT"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_what_is_not_audio_is_an_invalid_audio_error(case: str) -> None:
    with pytest.raises(InvalidAudioError, match="^Invalid or unsupported audio file: "):
        decode_audio(BAD_INPUTS[case](), LIMITS)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_cut_or_scrambled_files_decode_or_raise_invalid_audio_error_and_nothing_else(name: str) -> None:
    data = ENCODERS[name](tone(8_000, 1, seconds=1.0), 8_000)
    rng = np.random.default_rng(len(data))
    mutants = [data[: int(len(data) * f)] for f in (0.1, 0.5, 0.9)]
    for _ in range(6):
        scrambled = np.frombuffer(data, np.uint8).copy()
        scrambled[rng.integers(0, len(data), size=8)] = rng.integers(0, 256, size=8)
        mutants.append(scrambled.tobytes())
    for mutant in mutants:
        try:
            samples = decode_audio(mutant, LIMITS)
        except InvalidAudioError:
            continue
        assert samples.dtype == np.float32 and samples.ndim == 1 and np.isfinite(samples).all()


def test_the_file_size_is_checked_before_anything_is_decoded() -> None:
    limits = AudioLimits(max_file_bytes=1000)
    with pytest.raises(AudioTooLargeError, match="Maximum file size exceeded") as raised:
        decode_audio(b"\0" * 1001, limits)  # not audio: decoding would have said so
    assert (raised.value.limit, raised.value.value, raised.value.maximum) == ("max_file_bytes", 1001, 1000)
    decode_audio(ENCODERS["wav"](tone(8_000, 1, seconds=0.05), 8_000), limits)  # 844 bytes: fine


@pytest.mark.parametrize("name", ["wav", "flac", "mp3", "webm"])
def test_the_duration_limit_stops_the_decode_early(name: str) -> None:
    data = ENCODERS[name](tone(8_000, 1, seconds=60.0), 8_000)
    with pytest.raises(AudioTooLargeError, match="maximum duration of 2 s") as raised:
        decode_audio(data, AudioLimits(max_duration_s=2.0))
    # stopped within a block (1 s) or a packet of the limit, not after the whole minute
    assert raised.value.limit == "max_duration_s" and 2.0 < raised.value.value <= 3.5
    assert len(decode_audio(data, AudioLimits(max_duration_s=61.0))) / RATE == pytest.approx(60.0, rel=0.01)


def test_the_decoded_bytes_limit_counts_16khz_output() -> None:
    data = ENCODERS["mp3"](tone(44_100, 2, seconds=10.0), 44_100)
    limit = 2 * RATE * 4  # two seconds of float32 at 16 kHz
    with pytest.raises(AudioTooLargeError, match="Decoded audio exceeds") as raised:
        decode_audio(data, AudioLimits(max_decoded_bytes=limit))
    assert raised.value.limit == "max_decoded_bytes" and limit < raised.value.value <= 2 * limit


def test_a_playlist_in_the_upload_cannot_open_files_on_the_server(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FFmpeg's concat demuxer takes a bare relative name as safe and opens it from the working folder."""
    sf.write(tmp_path / "secret.wav", tone(8_000, 1)[0], 8_000)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidAudioError):
        decode_audio(b"ffconcat version 1.0\nfile 'secret.wav'\n", LIMITS)


def test_limits_come_from_engine_then_vllm_variables() -> None:
    assert AudioLimits.from_env({}) == AudioLimits()
    assert AudioLimits().max_file_bytes == 25 * 1024**2
    assert AudioLimits().decoded_bytes_limit(RATE) == (1800 + 1) * RATE * 4
    limits = AudioLimits.from_env(
        {
            "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "10",
            "ENGINE_MAX_AUDIO_CLIP_FILESIZE_MB": "2",
            "VLLM_MAX_AUDIO_DECODE_DURATION_S": "600",
            "VLLM_MAX_AUDIO_DECODE_BYTES": str(256 * 1024**2),
        }
    )
    assert limits == AudioLimits(2 * 1024**2, 600.0, 256 * 1024**2)
    assert AudioLimits.from_env({"ENGINE_MAX_AUDIO_DECODE_DURATION_S": "60"}).decoded_bytes_limit(24_000) == (
        61 * 24_000 * 4
    )
    for value in ("0", "-1", "lots", "inf"):
        with pytest.raises(ConfigError, match="ENGINE_MAX_AUDIO_DECODE_DURATION_S"):
            AudioLimits.from_env({"ENGINE_MAX_AUDIO_DECODE_DURATION_S": value})
    with pytest.raises(ConfigError, match="max_file_bytes"):
        AudioLimits(max_file_bytes=0)


def speechlike(seconds: float, quiet_at: list[float], seed: int = 0) -> np.ndarray:
    """Loud noise with 100 ms of near-silence (not zeros: a room's hiss) starting at each of `quiet_at`."""
    rng = np.random.default_rng(seed)
    samples = (0.3 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)
    for start_s in quiet_at:
        start = int(start_s * RATE)
        samples[start : start + RATE // 10] *= 0.003
    return samples


def test_long_audio_is_cut_in_its_quiet_moments() -> None:
    samples = speechlike(75.0, [29.5, 59.3])
    bounds = chunk_bounds(samples)
    assert len(bounds) == 3
    (first_cut, _), (second_cut, _) = bounds[1], bounds[2]
    assert 29.5 * RATE <= first_cut <= 29.6 * RATE
    assert 59.3 * RATE <= second_cut <= 59.4 * RATE
    chunks = split_audio(samples)
    assert np.array_equal(np.concatenate(chunks), samples)
    assert all(len(chunk) <= 30 * RATE for chunk in chunks)


@pytest.mark.parametrize("seconds", [0.5, 29.9, 30.0, 30.05, 61.0, 95.3])
def test_chunks_cover_the_audio_once_in_order_and_none_is_too_long(seconds: float) -> None:
    samples = speechlike(seconds, [], seed=int(seconds * 10))  # nowhere quiet: the cut still lands
    bounds = chunk_bounds(samples)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(samples)
    assert all(end == next_start for (_, end), (next_start, _) in zip(bounds, bounds[1:], strict=False))
    assert all(end - start <= 30 * RATE for start, end in bounds)
    # every cut is in the last second before a chunk's end
    assert all(end - start >= 29 * RATE for start, end in bounds[:-1])
    if seconds <= 30.0:
        assert bounds == [(0, len(samples))]


def test_chunking_refuses_what_it_cannot_cut() -> None:
    with pytest.raises(ValueError, match="1-D"):
        chunk_bounds(np.zeros((2, RATE), np.float32))
    with pytest.raises(ValueError, match="window_s <= search_s"):
        chunk_bounds(np.zeros(RATE, np.float32), search_s=2.0, window_s=3.0)
