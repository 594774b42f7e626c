"""Which decode batch sizes get a CUDA graph, and the captured size a step's batch runs at.

vLLM's capture list (vllm/config/vllm.py, _set_cudagraph_sizes, 0.34): 1, 2, 4, every multiple of 8 below
256, then every multiple of 16, up to the largest size; its default largest is min(2 x max_num_seqs, 512).
A decode batch never exceeds --max-num-seqs, so ours stops there (and --max-num-seqs itself is captured);
--max-cudagraph-capture-size lowers the bound, 0 turns graphs off like --enforce-eager. A decode step of n
rows runs the graph of the smallest captured size >= n, its extra rows padding whose outputs are
dropped; a larger step, or one with prefill rows, runs eagerly.
"""

from __future__ import annotations

import bisect

DEFAULT_MAX_CAPTURE = 512


def capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> list[int]:
    """The decode batch sizes captured at start, ascending; [] when graphs are off (max_capture_size 0)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    bound = DEFAULT_MAX_CAPTURE if max_capture_size is None else max_capture_size
    largest = min(max_num_seqs, bound)
    if largest <= 0:
        return []
    sizes = [size for size in (1, 2, 4) if size <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8)) + list(range(256, largest + 1, 16))
    if sizes[-1] != largest:
        sizes.append(largest)  # the largest batch a step may have gets a graph of its own
    return sizes


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The captured size a decode step of num_rows runs at; None: no graph that large (run eagerly)."""
    index = bisect.bisect_left(sizes, num_rows)
    return sizes[index] if index < len(sizes) else None
