"""glibc malloc settings for a worker's steps.

A step's activations are a few MB to tens of MB each, allocated and freed layer after layer. glibc
serves blocks that large with fresh mmaps (its threshold adapts only up to the largest block freed so
far, and it trims the heap top past twice that), so each step faulted in and zeroed much of its memory
again: ~40K page faults (~160 MiB) in one prefill step of 16 x 100 tokens, 0 with the thresholds raised;
that step took 489/599 ms against 735/719 ms (alternating runs, docs/performance.md), for +28 MiB RSS.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger("engine.worker")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap; glibc's largest allowed value
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap top before it is given back


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.info("mallopt refused the thresholds; steps allocate with the C library's defaults")
    return ok
