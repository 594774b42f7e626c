"""Integer weights of AWQ, GPTQ and compressed-tensors checkpoints in the tiles of csrc/quant_cpu.cpp: every
format's integers come here as q [N, K] with a float32 scale and offset per (row, group of g input dims), the
weight being fma(scale, q, offset) (= scale * (q - zero point), one rounding, where scale * zero is exact:
f16 or bf16 scales, and any scale with a power-of-two zero point).

A record per (group of 16 output rows, block of B input dims), as gguf_pack.py's with float32 scales:
    scale   f32 [16]           the 16 rows' scale for this block's group
    offset  f32 [16]           their offset
    low     u8 [B / 2][16]     4-bit types (unsigned q): byte c of a dim pair's 16 holds row c's first dim
                               (low nibble) and second dim (high nibble)
            i8 [B / 2][16][2]  I8_G64 (signed q): a dim pair's values, row by row
4-bit weights take blocks of their group size (32, 64 or 128; a larger group or a whole row repeats its scale
in blocks of the largest of these that divides it), 8-bit ones blocks of 64.

W8A8's weights (int8 per channel whose products take int8 activations, csrc/quant_w8a8.cpp) are I8_A8:
    scale   f32 [16]             the 16 rows' weight scales (the same in every block)
    sums    i32 [16]             each row's sum of this block's 64 values
    values  i8 [16][16][4]       per 4 consecutive dims, the 16 rows' 4 values side by side (vpdpbusd's order)
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

GROUP = 16


class IntType(IntEnum):
    """csrc/quant_blocks.h's QType values for the integer types (beyond GGML's)."""

    I4_G32 = 100
    I4_G64 = 101
    I4_G128 = 102
    I8_G64 = 103
    I8_A8 = 104
    MXFP4 = 105


BLOCK = {IntType.I4_G32: 32, IntType.I4_G64: 64, IntType.I4_G128: 128, IntType.I8_G64: 64, IntType.I8_A8: 64}


def int_type(bits: int, group: int, k: int, int8_rows: bool = False) -> IntType:
    """The type that holds `bits`-bit integers in groups of `group` input dims, of a weight K dims wide
    (int8_rows: the products take int8 activations, W8A8)."""
    if k % group:
        raise ValueError(f"a group of {group} dims does not divide the weight's {k} input dims")
    if int8_rows:
        if bits != 8 or group != k or k % 64:
            raise ValueError(f"W8A8 takes int8 weights with a scale per row and K a multiple of 64, not {bits}-bit "
                             f"groups of {group} of {k}")  # fmt: skip
        return IntType.I8_A8
    if bits == 8:
        if group % 64:
            raise ValueError(f"8-bit weights are served in groups of a multiple of 64 dims, not {group}")
        return IntType.I8_G64
    if bits != 4:
        raise ValueError(f"{bits}-bit integer weights are not served (4 and 8 are)")
    for block, qtype in ((128, IntType.I4_G128), (64, IntType.I4_G64), (32, IntType.I4_G32)):
        if group % block == 0:
            return qtype
    raise ValueError(f"4-bit weights are served in groups of a multiple of 32 dims, not {group}")


def record_bytes(qtype: IntType) -> int:
    return 128 + BLOCK[qtype] * (16 if qtype in (IntType.I8_G64, IntType.I8_A8) else 8)


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, qtype: IntType) -> np.ndarray:
    """q [N, K] (uint8 0-15, or int8 for I8_G64), scale and offset float32 [N, K / group] -> the tiles
    uint8 [N / 16, K / B, record]."""
    n, k = q.shape
    block = BLOCK[qtype]
    nb = k // block
    if qtype == IntType.I8_A8:
        return _pack_w8a8(q, scale)
    per_group = k // scale.shape[1] // block  # blocks that share a group's scale
    s = np.repeat(np.asarray(scale, dtype=np.float32), per_group, axis=1)  # [N, nb]
    o = np.repeat(np.asarray(offset, dtype=np.float32), per_group, axis=1)
    parts = [_across(s), _across(o)]
    values = q.reshape(n // GROUP, GROUP, nb, block).transpose(0, 2, 3, 1)  # [G, nb, B, 16]
    if qtype == IntType.I8_G64:  # a dim pair's 16 rows, each row's two values side by side
        pairs = (
            values.astype(np.int8).reshape(*values.shape[:2], block // 2, 2, GROUP).transpose(0, 1, 2, 4, 3)
        )
        parts.append(np.ascontiguousarray(pairs).view(np.uint8).reshape(*values.shape[:2], -1))
    else:
        low = values.astype(np.uint8).reshape(*values.shape[:2], block // 2, 2, GROUP)
        parts.append((low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*values.shape[:2], -1))
    record = np.concatenate(parts, axis=-1)
    assert record.shape[-1] == record_bytes(qtype), (qtype, record.shape)
    return np.ascontiguousarray(record)


def _across(field: np.ndarray) -> np.ndarray:
    """float32 [N, nb] -> [N / 16, nb, 64 bytes]: each block's 16 rows side by side."""
    n, nb = field.shape
    grouped = field.reshape(n // GROUP, GROUP, nb).transpose(0, 2, 1)
    return np.ascontiguousarray(grouped).view(np.uint8).reshape(n // GROUP, nb, -1)


def _pack_w8a8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q int8 [N, K], scale float32 [N, 1] -> I8_A8 records [N / 16, K / 64, 1152]."""
    n, k = q.shape
    nb = k // 64
    s = np.repeat(np.asarray(scale, dtype=np.float32).reshape(n, 1), nb, axis=1)
    sums = q.astype(np.int32).reshape(n, nb, 64).sum(-1, dtype=np.int32)  # [N, nb]
    quads = (
        q.astype(np.int8).reshape(n // GROUP, GROUP, nb, 16, 4).transpose(0, 2, 3, 1, 4)
    )  # [G, nb, 16, 16, 4]
    values = np.ascontiguousarray(quads).view(np.uint8).reshape(n // GROUP, nb, -1)
    record = np.concatenate([_across(s), _across(sums.view(np.float32)), values], axis=-1)
    assert record.shape[-1] == record_bytes(IntType.I8_A8), record.shape
    return np.ascontiguousarray(record)


def pack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's MXFP4: blocks uint8 [N, K / 32, 16] (two E2M1 codes a byte, the low nibble first), scales
    uint8 [N, K / 32] (E8M0) -> records [N / 16, K / 32, 272]: the 16 rows' exponents, then a dim pair's 16
    bytes per pair (byte c: row c's first code in the low nibble, its second in the high one)."""
    n, nb = scales.shape
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(n, nb, 32)  # [N, nb, 32] in dim order
    pairs = codes.reshape(n // GROUP, GROUP, nb, 16, 2).transpose(0, 2, 3, 1, 4)  # [G, nb, pairs, 16, 2]
    low = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8).reshape(n // GROUP, nb, -1)
    exponents = np.ascontiguousarray(scales.reshape(n // GROUP, GROUP, nb).transpose(0, 2, 1))
    return np.ascontiguousarray(np.concatenate([exponents, low], axis=-1))
