"""Sleep and wake for the worker (POST /sleep, /wake_up): its weights and KV cache out of its memory.

Level 1 writes every weight storage to a file, then gives its pages back to the kernel
(madvise(MADV_DONTNEED): the memory stays mapped, so every tensor, view and packed copy the model holds
keeps its address, and the native decoder stack's lists stay valid); wake reads the file back into the
same storages. Level 2 writes nothing: wake builds the model again from the checkpoint (the same code, so
the same layout) and copies each storage into the old one. The KV cache's pages are given back at either
level (the engine empties the prefix cache first); they come back as zeros when touched.

Only the pages wholly inside a storage are given back (its first and last partial pages stay).
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import psutil  # type: ignore[import-untyped]
import torch
from torch import nn

logger = logging.getLogger("engine.worker")

MADV_DONTNEED = 4  # linux/mman.h
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage under these tensors, once, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def model_tensors(model: nn.Module, extra: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and tensor attributes (packed copies, lists of
    them), module by module in a fixed order, then `extra` (e.g. the LoRA slots)."""
    found: list[torch.Tensor] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif (
            hasattr(value, "__dict__")
            and not isinstance(value, nn.Module)
            and type(value).__module__.startswith("worker.")
        ):
            for item in vars(value).values():  # e.g. the rotary tables
                visit(item)

    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            visit(value)
    found.extend(extra)
    return found


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes] uint8 over the storage


def release_pages(storage: torch.UntypedStorage) -> int:
    """Give the storage's whole pages back to the kernel; the bytes released."""
    madvise = getattr(ctypes.CDLL(None), "madvise", None)
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, end // PAGE_BYTES * PAGE_BYTES
    if madvise is None or last <= first:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0
    return last - first


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


class Sleeper:
    """The worker's sleep state. weights(): the model's tensors now; rebuild(): a new model (level 2)."""

    def __init__(self, cache_dir: str | None) -> None:
        self.cache_dir = cache_dir or tempfile.gettempdir()
        self.level = 0
        self.asleep: set[str] = set()
        self.path: str | None = None

    def sleep(self, level: int, weights: list[torch.Tensor], kv_caches: list[torch.Tensor]) -> dict[str, Any]:
        before, started = rss_bytes(), time.monotonic()
        released = 0
        if level == 1:
            fd, path = tempfile.mkstemp(prefix="engine-weights-", suffix=".bin", dir=self.cache_dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    for storage in storages(weights):
                        f.write(_bytes_of(storage).numpy().data)  # no copy of the bytes
            except BaseException:
                os.unlink(path)  # (a full disk): nothing kept, the worker awake as it was
                raise
            self.path = path
        for storage in storages(weights) + storages(kv_caches):
            released += release_pages(storage)
        self.level, self.asleep = level, {"weights", "kv_cache"}
        report = {"rss_before": before, "rss_asleep": rss_bytes(), "released": released}
        logger.info("asleep (level %d) in %.2f s: RSS %d -> %d MiB", level, time.monotonic() - started,
                    before >> 20, report["rss_asleep"] >> 20)  # fmt: skip
        return report

    def wake_kv(self) -> None:
        self.asleep.discard("kv_cache")  # the pages come back as zeros when the next step writes them

    def wake_weights(self, weights: list[torch.Tensor], rebuilt: list[torch.Tensor] | None) -> None:
        """Level 1: read the file back; level 2: copy the rebuilt model's storages in."""
        targets = storages(weights)
        if self.level == 1:
            assert self.path is not None
            with open(self.path, "rb") as f:
                for storage in targets:
                    f.readinto(memoryview(_bytes_of(storage).numpy()))  # type: ignore[arg-type]
            os.unlink(self.path)
            self.path = None
        else:  # tensor by tensor: a buffer's views may sit at another offset in the new one (alignment)
            assert rebuilt is not None
            if [tuple(t.shape) for t in rebuilt] != [tuple(t.shape) for t in weights]:
                raise RuntimeError("the reloaded model's layout differs from the one asleep")
            with torch.no_grad():
                for target, source in zip(weights, rebuilt, strict=True):
                    target.copy_(source)
        self.asleep.discard("weights")
