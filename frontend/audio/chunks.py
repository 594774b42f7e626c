"""Long audio -> chunks of at most `chunk_s` (Whisper hears 30 s at a time), each cut at the quietest
moment near its end, as vLLM's speech-to-text serving does (`_split_audio` / `_find_split_point`: 30 s
chunks, the last 1 s searched in 1600-sample windows, 100 ms at 16 kHz, for the lowest RMS energy).

Ours differs in two details: every window position in the searched second is tried (cumulative sums make
that one pass), not only those on a 100 ms grid, so a short pause is found wherever it falls; and the cut
is the middle of the quietest window, not its start, so both chunks end in the quiet.

Invariants: the chunks cover the samples exactly once and in order (`chunk_bounds` returns contiguous
[start, end) pairs from 0 to the end); none is longer than `chunk_s`; audio of at most `chunk_s` is one
chunk. Only a chunk's start offset is needed to place its timestamps (a segment at t s in chunk i is at
start_i / sample_rate + t in the file), which vLLM's first version got wrong by assuming i * 30 s.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def chunk_bounds(
    samples: npt.NDArray[np.floating],
    sample_rate: int = 16_000,
    chunk_s: float = 30.0,
    search_s: float = 1.0,
    window_s: float = 0.1,
) -> list[tuple[int, int]]:
    """[start, end) sample offsets of each chunk of the 1-D `samples`."""
    if samples.ndim != 1:
        raise ValueError(f"samples must be 1-D (mono), got shape {samples.shape}")
    chunk = int(chunk_s * sample_rate)
    search = int(search_s * sample_rate)
    window = int(window_s * sample_rate)
    if not 0 < window <= search <= chunk:
        raise ValueError(
            f"need 0 < window_s <= search_s <= chunk_s at {sample_rate} Hz, "
            f"got {window_s}, {search_s}, {chunk_s}"
        )
    bounds = []
    start = 0
    while len(samples) - start > chunk:
        cut = quietest_cut(samples, start + chunk - search, start + chunk, window)
        bounds.append((start, cut))
        start = cut
    bounds.append((start, len(samples)))
    return bounds


def split_audio(
    samples: npt.NDArray[np.floating],
    sample_rate: int = 16_000,
    chunk_s: float = 30.0,
    search_s: float = 1.0,
    window_s: float = 0.1,
) -> list[npt.NDArray[np.floating]]:
    """The chunks themselves, as views of `samples` (see `chunk_bounds` for their offsets)."""
    return [
        samples[start:end] for start, end in chunk_bounds(samples, sample_rate, chunk_s, search_s, window_s)
    ]


def quietest_cut(samples: npt.NDArray[np.floating], lo: int, hi: int, window: int) -> int:
    """The middle of the `window`-sample span within samples[lo:hi] with the lowest RMS energy (the first
    such span on a tie, as in true digital silence)."""
    squares = np.square(samples[lo:hi], dtype=np.float64)  # [hi - lo]
    sums = np.concatenate(([0.0], np.cumsum(squares)))  # [hi - lo + 1]
    energy = sums[window:] - sums[:-window]  # [hi - lo - window + 1]: window sums, one per start offset
    # comparing window sums is comparing RMS energies; over digital silence the running sum stays put, so
    # such a window's sum is exactly 0
    return lo + int(np.argmin(energy)) + window // 2
