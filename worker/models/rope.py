"""Rotary embeddings: cos/sin tables for every position, computed once in float32 as transformers does, for
the rope types a family may scale its rotary with (linear, dynamic, yarn, llama3, longrope), over all of a
head or its leading `rotary_dim` dims (partial rotary), rotating (i, i + dim / 2) pairs (HF's rotate_half)
or adjacent ones (2i, 2i + 1: Command R, GLM).

Two rope types depend on the sequence in transformers. `dynamic` (NTK) recomputes its frequencies for the
sequence's length once that passes max_position_embeddings (the default ones below it), at every forward: a
prompt's tokens all run on the prompt's length, each generated token on its own length (its position + 1),
and the cache keeps each key as it was rotated. So a token's rotation is a function of its position and of
its request's prompt length (`prompt_lens`): the decode rows (length = position + 1) are a second table at
positions + max_position, and the rows of a prompt longer than the limit are computed in the step.
`longrope` runs a sequence on its short factors while it is at most
original_max_position_embeddings long and on its long factors for every position once it is longer
(transformers' Phi-3 recomputes the whole sequence when it crosses): its table holds both, the long one at
positions + max_position, and the step's metadata says which rows are long (`long_rope`: the request's known
tokens are more than the switch length; the engine recomputes a request that crosses it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps


class RotaryEmbedding:
    """cos/sin tables [max_position, rotary_dim] in float32 (times the rope type's attention factor)."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        interleaved: bool = False,
    ) -> None:
        self.rotary_dim, self.interleaved = rotary_dim, interleaved
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        attention_factor = 1.0
        self.long_offset = 0  # >0: longrope's long factors, or dynamic NTK's decode rows, start here
        self.base, self.scaling = base, scaling
        self.dynamic_limit = 0  # >0: dynamic NTK past this length (max_position_embeddings)
        positions = torch.arange(max_position, dtype=torch.float32)
        if scaling:
            inv_freq, attention_factor = scaled_inv_freq(inv_freq, scaling, base, rotary_dim)
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim // 2]
        if scaling and rope_switch_length(scaling):
            long_freq, _ = _longrope(scaling, base, rotary_dim, long=True)
            freqs = torch.cat(
                (freqs, torch.outer(positions, long_freq))
            )  # [2 * max_position, rotary_dim // 2]
            self.long_offset = max_position
        limit = rope_length_limit(scaling)
        if scaling and limit is not None and max_position > limit:
            self.dynamic_limit = limit
            lengths = torch.arange(1, max_position + 1)  # a generated token's: its position + 1
            grown = positions[:, None] * dynamic_inv_freq(lengths, base, scaling, rotary_dim)
            freqs = torch.cat((freqs, grown))  # [2 * max_position, rotary_dim // 2]
            self.long_offset = max_position
        emb = self._emb(freqs)
        self.cos = (emb.cos() * attention_factor).to(device)
        self.sin = (emb.sin() * attention_factor).to(device)

    def _emb(self, freqs: torch.Tensor) -> torch.Tensor:
        """[n, rotary_dim // 2] angles -> [n, rotary_dim] as the pairs rotate."""
        if self.interleaved:
            return freqs.repeat_interleave(2, dim=-1)  # c0 c0 c1 c1 ...
        return torch.cat((freqs, freqs), dim=-1)  # c0 c1 ... c0 c1 ...

    def prepare(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        ops: CpuOps | None = None,
        long: torch.Tensor | None = None,  # [num_tokens] 1 where a longrope row runs on its long factors
        prompt_lens: torch.Tensor | None = None,  # [num_tokens] dynamic NTK: each row's prompt length
    ) -> Rope:
        """The step's rotation, shared by the layers of this table: looked up once (torch) or indexed per
        token (csrc, partial and interleaved rotary too)."""
        cos_table, sin_table = self.cos, self.sin
        if self.dynamic_limit and prompt_lens is not None:
            positions, cos_table, sin_table = self._dynamic_rows(positions, prompt_lens)
        elif self.long_offset and long is not None:
            positions = positions + long * self.long_offset
        if ops is not None:
            return Rope(positions, cos_table, sin_table, ops, self.rotary_dim, self.interleaved)
        cos = cos_table[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = sin_table[positions].to(dtype).unsqueeze(1)
        return Rope(positions, cos, sin, None, self.rotary_dim, self.interleaved)

    def _dynamic_rows(
        self, positions: torch.Tensor, prompt_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cos table, sin table) of a dynamic NTK step: a token runs on the length
        max(prompt length, position + 1); past the limit, a generated token's row is in the decode table,
        and a prompt token's (its prompt longer than the limit) is computed here, in a table of the step."""
        lengths = torch.maximum(prompt_lens, positions + 1)
        past = lengths > self.dynamic_limit
        if not bool(past.any()):
            return positions, self.cos, self.sin
        grown = past & (lengths == positions + 1)
        rows = positions + grown * self.long_offset
        held = past & ~grown
        if not bool(held.any()):
            return rows, self.cos, self.sin
        cos, sin = self.cos[rows], self.sin[rows]  # [num_tokens, rotary_dim]
        assert self.scaling is not None
        freqs = positions[held].float()[:, None] * dynamic_inv_freq(
            lengths[held], self.base, self.scaling, self.rotary_dim
        )
        emb = self._emb(freqs)
        cos[held], sin[held] = emb.cos(), emb.sin()  # (dynamic NTK's attention factor is 1)
        return torch.arange(positions.shape[0], device=positions.device), cos, sin


class Rope:
    def __init__(
        self,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: CpuOps | None,
        rotary_dim: int = 0,
        interleaved: bool = False,
    ) -> None:
        self.positions, self.cos, self.sin, self.ops = positions, cos, sin, ops
        self.rotary_dim, self.interleaved = rotary_dim, interleaved

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; csrc: in place."""
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, self.cos, self.sin, self.positions, self.interleaved)
            return q, k
        return rotate(q, self.cos, self.sin, self.interleaved), rotate(
            k, self.cos, self.sin, self.interleaved
        )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim] in x's dtype. The leading
    rotary_dim dims rotate (HF: x * cos + rotate_half(x) * sin), the rest pass."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :rotary_dim], cos, sin, interleaved), x[..., rotary_dim:]), dim=-1)
    if interleaved:  # pairs (2i, 2i + 1): (-x[2i + 1], x[2i])
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def scaled_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], base: float, dim: int
) -> tuple[torch.Tensor, float]:
    """transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py), for the lengths we serve."""
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind in ("default", "dynamic"):  # dynamic: the default frequencies up to max_position_embeddings
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(scaling, base, dim)
    if kind == "longrope":
        return _longrope(scaling, base, dim)
    if kind == "freq_factors":  # a GGUF file's rope_freqs: llama.cpp's divisor of each frequency (llama3)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries for {inv_freq.numel()} frequencies")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
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
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(scaling: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra = 1 - ramp
    return interpolation * (1 - extra) + extrapolation * extra, float(attention_factor)


def dynamic_inv_freq(lengths: torch.Tensor, base: float, scaling: dict[str, Any], dim: int) -> torch.Tensor:
    """Dynamic NTK's frequencies for sequences of these lengths ([n] int64 -> [n, dim // 2]), in float32
    op for op as transformers' _compute_dynamic_ntk_parameters computes them for one length (a tensor).
    Each length's base is computed alone, as there: a vector of them takes torch's vectorized pow, which
    differs from the one-element path in the last bit."""
    limit, factor = int(scaling["max_position_embeddings"]), scaling["factor"]
    distinct, index = torch.unique(lengths.cpu(), return_inverse=True)
    floor = torch.tensor(limit)
    bases = torch.stack([
        base * ((factor * torch.maximum(torch.tensor(n), floor) / limit) - (factor - 1)) ** (dim / (dim - 2))
        for n in distinct.tolist()
    ])  # fmt: skip
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / (bases[index][:, None] ** exponents)).to(lengths.device)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(
    scaling: dict[str, Any], base: float, dim: int, long: bool = False
) -> tuple[torch.Tensor, float]:
    """The short factors (a sequence within original_max_position_embeddings), or the long ones."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if long else "short_factor"
    factors = torch.tensor(scaling[name], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"longrope {name} has {factors.numel()} entries for {dim // 2} frequencies")
    inv_freq = 1.0 / (factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def rope_length_limit(scaling: dict[str, Any] | None) -> int | None:
    """Dynamic NTK: the length past which its frequencies change (None: another rope)."""
    if scaling and scaling.get("rope_type") == "dynamic":
        return int(scaling["max_position_embeddings"])
    return None


def rope_position_limit(scaling: dict[str, Any] | None, max_position_embeddings: int) -> int:
    """The positions a model serves: dynamic NTK's are its max_position_embeddings times its factor."""
    if rope_length_limit(scaling) is not None:
        assert scaling is not None
        return int(max_position_embeddings * float(scaling["factor"]))
    return max_position_embeddings


def rope_switch_length(scaling: dict[str, Any] | None) -> int:
    """longrope: the length past which a sequence runs on the long factors (0: no such switch)."""
    if scaling and scaling.get("rope_type") == "longrope":
        return int(scaling["original_max_position_embeddings"])
    return 0
