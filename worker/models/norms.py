"""The norms a family picks (ModelConfig.norm), each with transformers' rounding:

- "rms" (Llama): weight * dtype(x * rsqrt(mean(x^2) + eps)); the csrc kernels' rms_norm when built.
- "rms_offset" (Gemma): dtype(x * rsqrt(mean(x^2) + eps) * (1 + weight)), all in float32; the checkpoint
  holds the offset, `finalize()` turns it into 1 + weight in float32, which csrc's rms_norm then takes.
- "layer": F.layer_norm, with a bias where the checkpoint has one (GPT-NeoX, StarCoder2, StableLM).
- "cohere": Command R's LayerNorm, its explicit float32 formula (mean, variance, no bias).

Each takes `heads`: a norm over the last dim with a weight per head ([heads, size]; Command R's and
StableLM's q/k norms); and `add_and_norm(x, residual)`: the residual add a pre-norm decoder fuses with
its next norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.layers import RMSNorm

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps

NORMS = ("rms", "rms_offset", "layer", "cohere")


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * (1 + w), in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps, self.ops = eps, ops
        self.scale: torch.Tensor | None
        self.register_buffer(
            "scale", None, persistent=False
        )  # 1 + weight in float32, once loaded (moves with .to)

    def finalize(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and self.scale is not None and x.device.type == "cpu":
            # csrc rms_norm's float32-weight form: the same formula, one rounding (csrc/fused_cpu.cpp)
            return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.scale, self.eps).view(x.shape)
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None and self.scale is not None and x.device.type == "cpu":
            self.ops.fused_add_rms_norm(x, residual, self.scale, self.eps)  # in place, as RMSNorm's
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


class LayerNorm(nn.Module):
    """F.layer_norm over the last dim; `heads`: one weight per head ([heads, size]), no bias."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, bias: bool, heads: int = 0) -> None:
        super().__init__()
        shape = (heads, size) if heads else (size,)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False) if bias else None
        self.eps, self.size, self.heads = eps, size, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.heads:
            return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)
        # [num_tokens, heads, size]: each head its own norm (as StableLM's LayerNormPerHead runs them)
        heads = [
            F.layer_norm(x[:, h], (self.size,), self.weight[h], None, self.eps) for h in range(self.heads)
        ]
        return torch.stack(heads, dim=1)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.forward(residual), residual


class CohereLayerNorm(nn.Module):
    """Command R's LayerNorm: float32 mean and variance, (x - mean) * rsqrt(var + eps) * weight, no bias."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, heads: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty((heads, size) if heads else (size,), dtype=dtype), requires_grad=False
        )
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
        x32 = (x32 - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.forward(residual), residual


Norm = RMSNorm | OffsetRMSNorm | LayerNorm | CohereLayerNorm


def make_norm(
    kind: str,
    size: int,
    eps: float,
    dtype: torch.dtype,
    ops: CpuOps | None = None,
    bias: bool = False,
    heads: int = 0,
) -> Norm:
    """A norm of `kind` over `size` (the last dim); heads: a weight per head (LayerNorms only)."""
    if kind == "rms":
        assert not heads, "an RMS norm shares its weight across heads"
        return RMSNorm(size, eps, dtype, ops)
    if kind == "rms_offset":
        assert not heads, "an RMS norm shares its weight across heads"
        return OffsetRMSNorm(size, eps, dtype, ops)
    if kind == "layer":
        return LayerNorm(size, eps, dtype, bias and not heads, heads)
    if kind == "cohere":
        return CohereLayerNorm(size, eps, dtype, heads)
    raise ValueError(f"unknown norm {kind!r}; known: {', '.join(NORMS)}")
