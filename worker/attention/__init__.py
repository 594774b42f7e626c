"""Attention backends behind one interface; a lazy registry so optional ones load only when chosen.

- "torch": the reference (runs anywhere; the oracle).
- "cpu": csrc paged attention (decode rows, and prefill chunks up to a size), SDPA for longer prefill.
- "auto": "cpu" when the kernels build, else "torch".
"""

from __future__ import annotations

import logging

import torch

from worker.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk

logger = logging.getLogger("engine.worker")

BACKENDS = ("auto", "torch", "cpu")


def get_attention_backend(
    name: str, dtype: torch.dtype | None = None, batch_invariant: bool = False
) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKENDS)}")
    from worker.attention.torch_ref import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend()
    from worker.csrc_ops import load_cpu_ops

    ops = load_cpu_ops(build=True)
    if ops is None:
        if name == "cpu":
            raise RuntimeError("the 'cpu' attention backend needs the csrc kernels, which did not build")
        return TorchAttentionBackend()
    from worker.attention.cpu import CpuAttentionBackend

    return CpuAttentionBackend(ops, dtype, batch_invariant)


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillChunk", "get_attention_backend"]
