"""csrc linear_quant and quant_rows on the integer types of safetensors checkpoints (AWQ, GPTQ,
compressed-tensors; worker/quant/int_pack.py): 4-bit groups of 32, 64 and 128 dims (and larger groups, which
repeat their scale), 8-bit groups of 64 and whole rows. The rows dequantize to scale * (q - zero) bit for bit
(f16 scales, integer zero points: the exact products the checkpoints hold); the float32 product equals
linear_rows on those values bit for bit; float32 and bf16 are within rounding of a float64 product; each row
has the same bits alone and in a batch, at 1 to 512 rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.quant.blocks import IntBlocks
from worker.quant.int_pack import IntType, int_type

ROWS = (1, 2, 3, 5, 8, 9, 16, 97, 512)
CASES = [(4, 32, IntType.I4_G32), (4, 64, IntType.I4_G64), (4, 128, IntType.I4_G128), (4, 256, IntType.I4_G128),
         (8, 64, IntType.I8_G64), (8, 384, IntType.I8_G64)]  # fmt: skip


def random_weight(
    bits: int, group: int, n: int = 64, k: int = 768, seed: int = 0
) -> tuple[IntBlocks, np.ndarray]:
    """Every integer the type holds, f16 scales, zero points as the formats store them (unsigned 4-bit with
    a zero point; signed 8-bit with one)."""
    rng = np.random.default_rng(seed)
    groups = k // group
    scale = (rng.standard_normal((n, groups)) * 0.01).astype(np.float16).astype(np.float32)
    if bits == 4:
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        zero = rng.integers(0, 17, (n, groups)).astype(np.float32)
    else:
        q = rng.integers(-128, 128, (n, k), dtype=np.int8)
        zero = rng.integers(-128, 128, (n, groups)).astype(np.float32)
    return IntBlocks(bits, q, scale, -(scale * zero)), zero


@pytest.mark.parametrize(("bits", "group", "qtype"), CASES, ids=lambda c: str(c))
def test_rows_dequantize_to_scale_times_q_minus_zero(ops, bits, group, qtype) -> None:  # type: ignore[no-untyped-def]
    weight, zero = random_weight(bits, group)
    assert weight.qtype == qtype
    n, k = weight.shape
    scale, zero = np.repeat(weight.scale, group, axis=1), np.repeat(zero, group, axis=1)
    expected = torch.from_numpy((weight.q.astype(np.float32) - zero) * scale)
    assert torch.equal(weight.dequantize(), expected)
    packed = weight.packed()
    assert torch.equal(ops.quant_rows(packed, int(qtype), torch.arange(n), k, torch.float32), expected)
    ids = torch.tensor([3, 0, 63, 16])
    assert torch.equal(ops.quant_rows(packed, int(qtype), ids, k, torch.bfloat16), expected[ids].bfloat16())


@pytest.mark.parametrize(("bits", "group", "qtype"), CASES, ids=lambda c: str(c))
@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["float32", "bf16", "bf16-avx512"],
)  # fmt: skip
def test_products_on_integer_weights(ops, bits, group, qtype, dtype, amx) -> None:  # type: ignore[no-untyped-def]
    """bf16: the AMX form where the CPU has it, and (amx=False) the AVX-512 BF16 one."""
    if not amx and not ops.has_amx():
        pytest.skip("amx=False is the default form on a CPU without AMX (the bf16 case runs it)")
    weight, _ = random_weight(bits, group, seed=1)
    n, k = weight.shape
    dense = weight.dequantize()
    packed = weight.packed()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = [ops.linear_quant(x_all[i : i + 1], packed, int(qtype), bias, n, amx) for i in range(8)]
    rows_layout = ops.pack_rows(dense)
    for rows in ROWS:
        x = x_all[:rows]
        y = ops.linear_quant(x, packed, int(qtype), bias, n, amx)
        if dtype == torch.float32:
            assert torch.equal(y, ops.linear_rows(x, rows_layout, bias, n)), f"{rows} rows: not linear_rows'"
        exact = x.double() @ dense.double().T + bias.double()
        scale = x.double().abs() @ dense.double().abs().T + 1
        tolerance = 1e-5 * scale + (exact.abs() * 2.0**-8 + scale * 2.0**-8 if dtype == torch.bfloat16 else 0)
        assert bool(((y.double() - exact).abs() <= tolerance).all()), f"{rows} rows off the float64 product"
        for i in range(min(rows, 8)):
            assert torch.equal(y[i : i + 1], alone[i]), f"row {i} alone differs from row {i} of {rows}"


def test_groups_the_kernels_do_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        int_type(4, 16, 256)
    with pytest.raises(ValueError, match="multiple of 64"):
        int_type(8, 32, 256)
    with pytest.raises(ValueError, match="3-bit"):
        int_type(3, 128, 256)
    with pytest.raises(ValueError, match="does not divide"):
        int_type(4, 128, 320)


@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["float32", "bf16", "bf16-avx512"],
)  # fmt: skip
def test_mxfp4_rows_and_products(ops, dtype, amx) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss's MXFP4 (every E2M1 code, exponents around 2^-4): the rows are worker/models/mxfp4.py's
    dequantization bit for bit; the products linear_rows' on them (float32), within rounding of float64
    (bf16; the AMX form and the AVX-512 BF16 one where the CPU has AMX), each row alone as in a batch."""
    from worker.quant.blocks import Mxfp4Blocks

    if not amx and not ops.has_amx():
        pytest.skip("amx=False is the default form on a CPU without AMX (the bf16 case runs it)")

    rng = np.random.default_rng(4)
    n, k = 48, 256
    weight = Mxfp4Blocks(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8),
                         rng.integers(118, 130, (n, k // 32), dtype=np.uint8))  # fmt: skip
    dense = weight.dequantize()
    packed = weight.packed()
    assert torch.equal(ops.quant_rows(packed, weight.qtype, torch.arange(n), k, torch.float32), dense)
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(n)
    rows_layout = ops.pack_rows(dense)
    alone = [ops.linear_quant(x_all[i : i + 1], packed, weight.qtype, bias, n, amx) for i in range(4)]
    for rows in ROWS:
        x = x_all[:rows]
        y = ops.linear_quant(x, packed, weight.qtype, bias, n, amx)
        if dtype == torch.float32:
            assert torch.equal(y, ops.linear_rows(x, rows_layout, bias, n))
        exact = x.double() @ dense.double().T + bias.double()
        scale = x.double().abs() @ dense.double().abs().T + 1
        tolerance = 1e-5 * scale + (exact.abs() * 2.0**-8 + scale * 2.0**-8 if dtype == torch.bfloat16 else 0)
        assert bool(((y.double() - exact).abs() <= tolerance).all())
        for i in range(min(rows, 4)):
            assert torch.equal(y[i : i + 1], alone[i])
