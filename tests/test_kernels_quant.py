"""csrc linear_quant and quant_rows (csrc/quant_cpu.cpp) on GGUF blocks packed by worker/quant/gguf_pack.py,
for every type served packed: the rows dequantize to the `gguf` package's numpy values bit for bit; the
product equals linear_rows on those float32 values bit for bit (so the model equals its dequantized float32
self), is within float32 rounding of a float64 product, and gives each row the same bits alone and in a
batch, at 1 to 512 rows, in float32 and bf16 (bf16 rows with AVX-512 BF16 take the scale out of each
sub-block, csrc/quant_cpu.cpp: within float32 rounding of float64 before the output's one rounding). The blocks are random bytes with sane f16 scales: every
integer and every 6-bit scale pattern the format can hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from worker.quant.gguf_pack import PACKED_TYPES, Q, pack, q3_k_as_q6_k

F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
          Q.Q2_K: [80, 82], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q3_K: [108]}  # fmt: skip
ROWS = (1, 2, 3, 4, 5, 6, 7, 16, 25, 67, 97, 512)


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """The file's bytes of a random [n, k] weight: random blocks whose f16 fields are small normals."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for at in F16_AT[qtype]:
        raw[..., at : at + 2] = (
            (rng.standard_normal((n, k // size, 1)) * 0.01).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(n, -1)


def shape_of(qtype: Q) -> tuple[int, int]:
    return (80, 512) if GGML_QUANT_SIZES[qtype][0] == 256 else (80, 160)  # 5 groups: a quad and one more


def test_q3_k_served_as_q6_k_blocks_is_the_same_values(ops) -> None:  # type: ignore[no-untyped-def]
    """Q3_K's blocks rewritten as Q6_K's (every 3-bit value and 6-bit scale the format holds): the gguf
    package's Q6_K dequantization of them, and the tiles' rows, are its Q3_K values bit for bit."""
    raw = random_blocks(Q.Q3_K, 64, 512)
    expected = np.asarray(dequantize(raw, Q.Q3_K), dtype=np.float32).reshape(64, 512)
    q6 = q3_k_as_q6_k(raw)
    assert q6.shape == (64, 2 * 210)
    assert np.array_equal(np.asarray(dequantize(q6, Q.Q6_K)).view(np.uint32), expected.view(np.uint32))
    packed = torch.from_numpy(pack(q6, Q.Q6_K, (64, 512)))
    rows = ops.quant_rows(packed, int(Q.Q6_K), torch.arange(64), 512, torch.float32)
    assert torch.equal(rows, torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_rows_dequantize_to_the_gguf_packages_values(ops, qtype) -> None:  # type: ignore[no-untyped-def]
    n, k = shape_of(qtype)
    raw = random_blocks(qtype, n, k)
    expected = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    packed = torch.from_numpy(pack(raw, qtype, (n, k)))
    ids = torch.tensor([5, 0, 63, 16, 5])
    assert torch.equal(ops.quant_rows(packed, int(qtype), torch.arange(n), k, torch.float32), expected)
    assert torch.equal(ops.quant_rows(packed, int(qtype), ids, k, torch.float32), expected[ids])
    assert torch.equal(ops.quant_rows(packed, int(qtype), ids, k, torch.bfloat16), expected[ids].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        ops.quant_rows(packed, int(qtype), torch.tensor([n]), k, torch.float32)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["float32", "bf16", "bf16-avx512"],
)  # fmt: skip
def test_products_equal_linear_rows_on_the_dequantized_weight(ops, qtype, dtype, amx) -> None:  # type: ignore[no-untyped-def]
    """bf16: on a CPU with AMX the tile form (csrc/quant_amx.h) and, with amx=False, the AVX-512 BF16 one."""
    if not amx and not ops.has_amx():
        pytest.skip("amx=False is the default form on a CPU without AMX (the bf16 case runs it)")
    n, k = shape_of(qtype)
    raw = random_blocks(qtype, n, k, seed=1)
    weight = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    packed = torch.from_numpy(pack(raw, qtype, (n, k)))
    rows_layout = ops.pack_rows(weight)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    alone = [ops.linear_quant(x_all[i : i + 1].to(dtype), packed, int(qtype), bias, n, amx) for i in range(8)]
    for rows in ROWS:
        x = x_all[:rows]
        y = ops.linear_quant(x.to(dtype), packed, int(qtype), bias, n, amx)
        assert y.dtype == dtype and y.shape == (rows, n)
        if not (dtype == torch.bfloat16 and ops.pairs_available()):  # (bf16 with AVX-512 BF16: the scales
            # factored out of each sub-block, checked against float64 below)
            reference = ops.linear_rows(x.to(dtype).float(), rows_layout, bias, n).to(dtype)
            assert torch.equal(y, reference), f"{rows} rows differ from linear_rows on the dequantized weight"
        exact = x.to(dtype).double() @ weight.double().T + bias.double()
        tolerance = 1e-5 * (x.to(dtype).double().abs() @ weight.double().abs().T + 1)
        if dtype == torch.bfloat16:  # the output rounded to bf16 (and, with dim pairs, each weight)
            tolerance = (
                tolerance
                + exact.abs() * 2.0**-8
                + x.to(dtype).double().abs() @ weight.double().abs().T * 2.0**-8
            )
        assert bool(((y.double() - exact).abs() <= tolerance).all()), f"{rows} rows off the float64 product"
        for i in range(min(rows, 8)):
            assert torch.equal(y[i : i + 1], alone[i]), f"row {i} alone differs from row {i} of {rows}"


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_the_csrc_packer_writes_the_numpy_specifications_bytes(ops, qtype) -> None:  # type: ignore[no-untyped-def]
    """csrc pack_gguf (a worker's start) against worker/quant/gguf_pack.py's numpy pack, byte for byte: every
    integer and scale pattern (random_blocks), several groups of 16 rows and blocks."""
    n, k = (48, 768) if GGML_QUANT_SIZES[qtype][0] == 256 else (48, 224)
    raw = random_blocks(qtype, n, k, seed=4)
    expected = pack(raw, qtype, (n, k))
    got = ops.pack_gguf(torch.from_numpy(raw), int(qtype), n, k)
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), expected)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_gguf(torch.from_numpy(raw[:40]), int(qtype), 40, k)
    with pytest.raises(RuntimeError, match="not one of ours"):
        ops.pack_gguf(torch.from_numpy(raw), int(Q.IQ4_NL), n, k)


def test_a_packing_that_does_not_match_is_refused(ops) -> None:  # type: ignore[no-untyped-def]
    raw = random_blocks(Q.Q4_K, 32, 512)
    packed = torch.from_numpy(pack(raw, Q.Q4_K, (32, 512)))
    with pytest.raises(RuntimeError, match="does not match K"):
        ops.linear_quant(torch.randn(1, 256), packed, int(Q.Q4_K), torch.empty(0), 32)
    with pytest.raises(RuntimeError, match="not one of ours"):
        ops.linear_quant(torch.randn(1, 512), packed, int(Q.IQ4_NL), torch.empty(0), 32)
