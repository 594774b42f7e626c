"""MXFP4 (OCP microscaling FP4) weights dequantized at load, as gpt-oss checkpoints ship their experts:
`*_blocks` uint8 [..., rows, groups, 16], two E2M1 values a byte (the low nibble first), and `*_scales`
uint8 [..., rows, groups], one E8M0 exponent (bias 127) per group of 32 values. The quantization issue
keeps them packed; until then the experts run dequantized (worker/models/families/gpt_oss.py)."""

from __future__ import annotations

import torch

# E2M1's 16 codes: sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., rows, groups, 16] uint8, scales [..., rows, groups] uint8 -> [..., rows, groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
            f"{scales.dtype} do not pair (uint8 [..., groups, 16] and [..., groups])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., g, 16, 2]
    values = values.flatten(-2)  # [..., rows, groups, 32]
    # each group times 2 ** (scale - 127): exact in float32 (ldexp), rounded once to the dtype
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)
