"""The worker's malloc settings (worker/host_memory.py), checked in a fresh interpreter each: glibc's
thresholds are process-wide and adapt to what the process freed before."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    from worker.host_memory import keep_freed_memory
    assert keep_freed_memory()
activation = torch.empty(8 << 20, dtype=torch.bfloat16)  # 16 MiB, a prefill step's gate/up output
mapped = libc.mallinfo2().hblkhd
del activation
print(mapped >> 20, libc.mallinfo2().fordblks >> 20)
"""


def probe(mode: str) -> tuple[int, int]:
    """(MiB in mmapped blocks while a 16 MiB tensor lives, MiB free in the heap after it is freed)"""
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    mapped, kept = run.stdout.split()
    return int(mapped), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_activations_come_from_the_heap_and_stay_there() -> None:
    default_mapped, default_kept = probe("default")
    assert default_mapped >= 16 and default_kept < 16  # glibc's default: a fresh mmap, given back on free
    tuned_mapped, tuned_kept = probe("tuned")
    assert tuned_mapped < 16 and tuned_kept >= 16  # tuned: heap memory, kept for the next step
