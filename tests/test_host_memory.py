"""The worker's malloc settings (worker/host_memory.py), checked in a fresh interpreter each: glibc's
thresholds are process-wide and adapt to what the process freed before."""

from __future__ import annotations

import os
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


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields: dict[str, str] = {}
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                if found:
                    break
                low, high = (int(bound, 16) for bound in head.split("-"))
                found = low <= address < high
            elif found:
                fields[head.rstrip(":")] = rest.strip()
    assert found, hex(address)
    return fields


def test_kv_cache_buffer_is_zeroed_aligned_and_advised_for_huge_pages() -> None:
    import torch

    from worker.host_memory import HUGE_PAGE_BYTES, MMAP_THRESHOLD, zeroed_pool

    large = zeroed_pool([(MMAP_THRESHOLD,)], torch.bfloat16)  # a fresh mapping, faulted in on a thread
    assert not large[0].any() and large[0].data_ptr() % HUGE_PAGE_BYTES == 0
    shapes = [(64, 2, 16, 3, 64)] * 3 + [(5, 7)]
    tensors = zeroed_pool(shapes, torch.bfloat16)  # below the threshold: zeroed here
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 and not t.any() for t in tensors)
    assert tensors[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for before, after in zip(tensors[:-1], tensors[1:], strict=True):  # back to back in one buffer
        assert after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
    tensors[1].fill_(1)  # the views do not overlap
    assert not tensors[0].any() and not tensors[2].any() and tensors[1].all()
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # a Linux kernel with THP
        assert "hg" in mapping_of(tensors[0].data_ptr())["VmFlags"].split()  # MADV_HUGEPAGE took
