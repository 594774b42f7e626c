"""Building blocks shared by the model families: RMSNorm and rotary embeddings, HF-exact numerics."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as Hugging Face: normalize in float32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding:
    """cos/sin tables for every position, computed once in float32 (rotate-half convention)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        if scaling:
            inv_freq, attention_factor = _scale_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.cos = (emb.cos() * attention_factor).to(device)
        self.sin = (emb.sin() * attention_factor).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
