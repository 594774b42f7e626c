"""Attention backends behind one interface; a lazy registry so optional ones import only when chosen."""

from __future__ import annotations

from worker.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from worker.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: ['torch']")


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillChunk", "get_attention_backend"]
