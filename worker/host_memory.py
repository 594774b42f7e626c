"""Host memory for a worker: glibc malloc settings for its steps; the KV cache and weights on huge pages.

A step's activations are a few MB to tens of MB each, allocated and freed layer after layer. glibc
serves blocks that large with fresh mmaps (its threshold adapts only up to the largest block freed so
far, and it trims the heap top past twice that), so each step faulted in and zeroed much of its memory
again: ~40K page faults (~160 MiB) in one prefill step of 16 x 100 tokens, 0 with the thresholds raised;
that step took 489/599 ms against 735/719 ms (alternating runs,
benchmarks/results/2026-11-29-lab-notes-performance.md, "Where a step goes now"), for +28 MiB RSS.

Decode steps read all of the KV cache they attend over and all of the weights: on 4 KiB pages that is a
TLB miss every few KiB (a layer's cache is ~36 MiB, wherever the pool put its blocks). The KV cache and
the decode products' weights each live in one buffer aligned to 2 MiB and advised MADV_HUGEPAGE, so they
get huge pages even where the kernel's THP mode is "madvise"
(benchmarks/results/2026-11-29-lab-notes-performance.md, "Huge pages and 64-token blocks": decode
attention over a shuffled pool 0.42 -> 0.37 ms a layer at 64 x 164 tokens; decode steps at batch 1 -12%, 16 -5%, 64 -3%).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import threading
from typing import Any

import torch

logger = logging.getLogger("engine.worker")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap; glibc's largest allowed value
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap top before it is given back
MADV_HUGEPAGE = 14  # madvise advice (linux/mman.h)
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK_BYTES = 64 << 20
HUGE_PAGE_BYTES = 2 << 20


def _libc(name: str) -> Any | None:
    """A function of the process's own C library on Linux (glibc's), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.info("mallopt refused the thresholds; steps allocate with the C library's defaults")
    return ok


def trim_freed_memory() -> bool:
    """Give the heap's free pages back to the system (malloc_trim); False where there is no glibc."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def empty_on_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialized tensors of these shapes, back to back in one buffer aligned to 2 MiB and advised for
    transparent huge pages before any of it is touched; default pages where madvise is refused."""
    num_bytes = sum(math.prod(shape) * dtype.itemsize for shape in shapes)
    raw = torch.empty(num_bytes + HUGE_PAGE_BYTES, dtype=torch.uint8)  # large: a fresh mapping, no pages yet
    return _views_on_huge_pages(raw, shapes, dtype)


def _views_on_huge_pages(
    raw: torch.Tensor, shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> list[torch.Tensor]:
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    num_bytes = sum(sizes)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    buffer = raw[start : start + num_bytes]
    if not _advise_huge_pages(buffer.data_ptr(), num_bytes):
        logger.info("madvise(MADV_HUGEPAGE) refused; %d MiB stay on the default pages", num_bytes >> 20)
    tensors, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        tensors.append(buffer[offset : offset + size].view(dtype).view(shape))
        offset += size
    return tensors


def zeroed_pool(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed tensors on huge pages (the KV cache). A large pool is an anonymous mapping of its own, which
    the kernel hands out as zeros, faulted in on a thread (fault_in_background); a small one is zeroed here.
    NOTE: not malloc's memory: with the trim threshold raised, malloc served a 66 MB block from freed heap
    memory that still held old values (tests/test_host_memory.py)."""
    num_bytes = sum(math.prod(shape) * dtype.itemsize for shape in shapes)
    if num_bytes <= MMAP_THRESHOLD:
        tensors = empty_on_huge_pages(shapes, dtype)
        for tensor in tensors:
            tensor.zero_()
        return tensors
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES)  # the tensors keep it alive
    tensors = _views_on_huge_pages(torch.frombuffer(mapping, dtype=torch.uint8), shapes, dtype)
    fault_in_background(tensors)
    return tensors


def fault_in_background(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Fault in the pages of tensors that lie back to back in one fresh mapping (empty_on_huge_pages),
    on a thread, without writing to them: they read as zeros and steps may write them meanwhile.

    NOTE: the first touch of memory is what a KV pool costs at start: 1 GiB took 1.9-4.3 s to fault in on
    this VM (AMD EPYC, 2026-12-01), most of a 5-second start. MADV_POPULATE_WRITE (Linux 5.14) faults the
    pages in as writes would; where it is refused, they fault in when steps first write them.
    """
    madvise = _libc("madvise")
    if madvise is None or not tensors:
        return None
    start = tensors[0].data_ptr()
    end = tensors[-1].data_ptr() + tensors[-1].numel() * tensors[-1].element_size()
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def populate() -> None:
        # NOTE: at the lowest priority: a step's two OpenMP threads wait for the slower one, and beside
        # this thread at normal priority a decode step took twice as long (30 vs 60 ms, AVX2 EPYC, 12-01)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: a thread's own nice
        except (AttributeError, OSError):
            pass
        for address in range(start, end, POPULATE_CHUNK_BYTES):  # ctypes lets go of the GIL in each call
            if madvise(address, min(POPULATE_CHUNK_BYTES, end - address), MADV_POPULATE_WRITE) != 0:
                return

    thread = threading.Thread(target=populate, args=(), name="kv-fault-in", daemon=True)
    thread.start()
    return thread


def _advise_huge_pages(address: int, num_bytes: int) -> bool:
    madvise = _libc("madvise")
    if madvise is None or num_bytes == 0:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return bool(madvise(address, num_bytes, MADV_HUGEPAGE) == 0)
