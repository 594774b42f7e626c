"""GGUF's quantized blocks rearranged for csrc/quant_cpu.cpp ("tiles"): the same integers and the same f16
scales, 16 output rows side by side, so that a product reads each of the file's bytes once and widens 16
rows' weights of one input dim in a few instructions.

A record per (group of 16 rows, GGUF block of B input dims), its fields one after another:
    d        f16 [16]            every type
    m / dmin f16 [16]            Q4_1, Q5_1 (m); Q2_K, Q4_K, Q5_K (dmin)
    scales   u8 [subs][16]       Q4_K, Q5_K (6-bit scales, then the 6-bit mins); Q2_K (4-bit ones, subs = 16);
                                 Q6_K (int8, subs = 16)
    low      u8 [B / 2][16]      the low 4 bits: byte c of a dim pair's 16 holds row c's first dim (low
                                 nibble) and second dim (high nibble); Q2_K's 2-bit values as nibbles
             i8 [B / 2][16][2]   Q8_0: a dim pair's values, row by row
    high     u16 [B] / u32 [B]   5-bit types: bit c is row c's fifth bit; Q6_K: bits 2c, 2c + 1 its top two
Sizes per weight equal the file's but for Q4_K/Q5_K's scales, kept a byte each (2.8% and 2.3% more), and
Q2_K, whose 2-bit values take a nibble (5.1 bits a weight for the file's 2.6; a third of bf16's 16).
The integers and scales are read the way the `gguf` package's dequantize_blocks reads them (gguf.quants).
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

GROUP = 16
Q = GGMLQuantizationType
PACKED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
RECORD_BYTES = {Q.Q2_K: 2624, Q.Q4_0: 288, Q.Q4_1: 320, Q.Q5_0: 352, Q.Q5_1: 384, Q.Q8_0: 544,
                Q.Q4_K: 2368, Q.Q5_K: 2880, Q.Q6_K: 3360}  # fmt: skip


def block_size(qtype: int) -> int:
    return int(GGML_QUANT_SIZES[Q(qtype)][0])


def can_pack(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a [N, K] weight of this type takes the tiles layout: N a multiple of 16 (K is whole blocks)."""
    return Q(qtype) in PACKED_TYPES and len(shape) == 2 and shape[0] % GROUP == 0


def pack(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> np.ndarray:
    """raw: the file's uint8 blocks [N, K / B * bytes per block] -> the tiles [N / 16, K / B, record]."""
    qtype = Q(qtype)
    n, k = shape
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // size, nbytes)
    fields, q = _fields(blocks, qtype)  # [N, nb, ...] each; q [N, nb, B] uint8 (Q8_0: int8 bits)
    parts = [_across(field) for field in fields]
    q = q.reshape(n // GROUP, GROUP, k // size, size).transpose(0, 2, 3, 1)  # [G, nb, B, 16]
    if qtype == Q.Q8_0:  # a dim pair's 16 rows, each row's two values side by side
        pairs = q.reshape(*q.shape[:2], size // 2, 2, GROUP).transpose(0, 1, 2, 4, 3)
        parts.append(np.ascontiguousarray(pairs).reshape(*q.shape[:2], -1))
    else:
        low = (q & 15).reshape(*q.shape[:2], size // 2, 2, GROUP)  # [G, nb, dim pairs, 2, 16]
        parts.append((low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*q.shape[:2], -1))
        high_bits = 1 if qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K) else 2 if qtype == Q.Q6_K else 0
        if high_bits:
            top = ((q >> 4) & ((1 << high_bits) - 1)).astype(np.uint32)
            shifts = np.arange(GROUP, dtype=np.uint32) * high_bits
            bits = (top << shifts).sum(axis=-1, dtype=np.uint32)  # [G, nb, B]
            bits = bits.astype("<u2" if high_bits == 1 else "<u4")
            parts.append(bits.view(np.uint8).reshape(*q.shape[:2], -1))
    record = np.concatenate(parts, axis=-1)
    assert record.shape[-1] == RECORD_BYTES[qtype], (qtype, record.shape)
    return np.ascontiguousarray(record)


def _across(field: np.ndarray) -> np.ndarray:
    """[N, nb, ...] per row -> [N / 16, nb, ... bytes, 16 rows] flattened per (group, block)."""
    n, nb = field.shape[:2]
    grouped = field.reshape(n // GROUP, GROUP, nb, -1).transpose(0, 2, 3, 1)  # [G, nb, items, 16]
    return np.ascontiguousarray(grouped).view(np.uint8).reshape(n // GROUP, nb, -1)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.uint16)  # [N, nb, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_0/Q5_1's 16 bytes -> 32 values: the low nibbles are 0-15, the high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fields(blocks: np.ndarray, qtype: Q) -> tuple[list[np.ndarray], np.ndarray]:
    n, nb = blocks.shape[:2]
    if qtype == Q.Q8_0:
        return [_f16(blocks, 0)], blocks[..., 2:34].copy()
    if qtype in (Q.Q4_0, Q.Q4_1):
        first = 2 if qtype == Q.Q4_0 else 4
        fields = [_f16(blocks, 0)] + ([_f16(blocks, 2)] if qtype == Q.Q4_1 else [])
        return fields, _nibbles(blocks[..., first : first + 16])
    if qtype in (Q.Q5_0, Q.Q5_1):
        at = 2 if qtype == Q.Q5_0 else 4
        fields = [_f16(blocks, 0)] + ([_f16(blocks, 2)] if qtype == Q.Q5_1 else [])
        qh = np.ascontiguousarray(blocks[..., at : at + 4]).view("<u4")  # [N, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return fields, _nibbles(blocks[..., at + 4 : at + 20]) | (high << 4)
    if qtype in (Q.Q4_K, Q.Q5_K):
        scales = blocks[..., 4:16].reshape(n * nb, 12)
        sc, mins = (np.asarray(v).reshape(n, nb, 8).astype(np.uint8) for v in Q4_K.get_scale_min(scales))
        qs = blocks[..., 16:144] if qtype == Q.Q4_K else blocks[..., 48:176]
        low = (qs.reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15
        q = low.reshape(n, nb, 8, 32)
        if qtype == Q.Q5_K:
            qh = blocks[..., 16:48].reshape(n, nb, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
        return [_f16(blocks, 0), _f16(blocks, 2), sc, mins], q.reshape(n, nb, 256)
    if qtype == Q.Q2_K:  # scales[16] (min << 4 | scale), qs[64] (2-bit values), d, dmin
        scales = blocks[..., :16]
        qs = blocks[..., 16:80].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 1, 4, 1
        )
        return [_f16(blocks, 80), _f16(blocks, 82), scales & 15, scales >> 4], (qs & 3).reshape(n, nb, 256)
    assert qtype == Q.Q6_K
    ql = (
        blocks[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ) & 15
    qh = (
        blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
        >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    ) & 3
    q = ql.reshape(n, nb, 8, 32) | (qh.reshape(n, nb, 8, 32) << 4)
    return [_f16(blocks, 208), blocks[..., 192:208].copy()], q.reshape(n, nb, 256)


def q3_k_as_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q3_K blocks (uint8 [..., K / 256 * 110]) rewritten as Q6_K blocks ([..., K / 256 * 210]) of the very
    same values: Q3_K's weight is (d * (scale - 32)) * q with a 6-bit scale and q in [-4, 3] per 16 dims, and
    Q6_K's is (d * scale) * (q6 - 32) with an int8 scale per 16 dims, computed alike (gguf.quants), so scale
    - 32 and q + 32 give each weight bit for bit. The tiles then serve it (1.9x Q3_K's bytes, 0.4x bf16's)."""
    shape = raw.shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 110)
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:110]
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(
        n, 16
    )
    scales = ((low & 15) | ((high & 3) << 4)).astype(np.int16) - 32  # [n, 16] in [-32, 31]
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = ql.reshape(n, 256).astype(np.int16) - ((qh.reshape(n, 256) ^ 1).astype(np.int16) << 2)  # [-4, 3]
    q6 = (q + 32).astype(np.uint8).reshape(n, 2, 128)  # Q6_K's halves of 128 values
    out_ql = (q6[:, :, :64] & 15) | ((q6[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    tops = (q6 >> 4).reshape(n, 2, 4, 32)
    out_qh = tops[:, :, 0] | (tops[:, :, 1] << 2) | (tops[:, :, 2] << 4) | (tops[:, :, 3] << 6)  # [n, 2, 32]
    out = np.concatenate(
        [out_ql.reshape(n, 128), out_qh.reshape(n, 64), scales.astype(np.int8).view(np.uint8), d], axis=1
    )
    return out.reshape(*shape[:-1], shape[-1] // 110 * 210)
