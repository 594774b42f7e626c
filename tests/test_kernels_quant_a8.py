"""csrc linear_quant_a8 (csrc/quant_a8.cpp, --activation-quantization int8): packed weights of every type
served packed, GGUF's and the integer ones, times each row quantized to int8 per 32 dims. Against a float64
product of the `gguf` package's (or the integer formats') dequantized weights and the rows quantized here in
numpy float32 as the contract says: within float32 rounding. The vector kernel and the portable loop give the
same bits, and each row the same bits alone and in a batch (batch-invariant), at 1 to 67 rows. The vector
kernel is AVX-512 VNNI's where the CPU has it and VBMI (Zen 4, Sapphire Rapids), else AVX2's (Zen 3; on a Zen 4, a
build with -march=znver3 runs it); without AVX2 both sides of that comparison are the portable loop, and the
numpy and batch checks still cover it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.test_kernels_quant import random_blocks, shape_of
from tests.test_kernels_quant_int import random_weight
from worker.quant.gguf_pack import PACKED_TYPES, pack

ROWS = (1, 3, 8, 9, 16, 25, 67)


def quantized_rows(x: torch.Tensor) -> np.ndarray:
    """x as the kernel multiplies it: per row and block of 32 dims, d * round-half-even(x * (127 / max |x|)),
    with d = max |x| / 127, in float32; returned as float64."""
    blocks = x.float().numpy().reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(-1, keepdims=True)
    safe = np.where(top > 0, top, np.float32(1))
    inverse = np.where(top > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.rint((blocks * inverse).astype(np.float32))
    d = (top / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape[0], -1)


def check(ops, packed: torch.Tensor, qtype: int, weight: np.ndarray, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    n, k = weight.shape
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x_all = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3)).to(dtype)
    x_all[5, :32] = 0  # a block of zeros (d = 0)
    alone = [ops.linear_quant_a8(x_all[i : i + 1], packed, qtype, bias, n) for i in range(9)]
    for rows in ROWS:
        x = x_all[:rows]
        y = ops.linear_quant_a8(x, packed, qtype, bias, n)
        assert y.dtype == dtype and y.shape == (rows, n)
        assert torch.equal(y, ops.linear_quant_a8(x, packed, qtype, bias, n, reference=True)), (
            f"{rows} rows: the vector kernel and the portable loop differ"
        )
        xq = quantized_rows(x)
        exact = xq @ weight.T + bias.double().numpy()
        tolerance = 1e-5 * (np.abs(xq) @ np.abs(weight).T + 1)
        if dtype == torch.bfloat16:
            tolerance = tolerance + np.abs(exact) * 2.0**-8
        assert bool((np.abs(y.double().numpy() - exact) <= tolerance).all()), f"{rows} rows off the product"
        for i in range(min(rows, 9)):
            assert torch.equal(y[i : i + 1], alone[i]), f"row {i} alone differs from row {i} of {rows}"


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_gguf_types_with_int8_rows(ops, qtype, dtype) -> None:  # type: ignore[no-untyped-def]
    n, k = shape_of(qtype)
    raw = random_blocks(qtype, n, k, seed=1)
    weight = np.asarray(dequantize(raw, qtype), dtype=np.float64).reshape(n, k)
    check(ops, torch.from_numpy(pack(raw, qtype, (n, k))), int(qtype), weight, dtype)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 128), (8, 64)], ids=str)
def test_integer_types_with_int8_rows(ops, bits, group) -> None:  # type: ignore[no-untyped-def]
    blocks, _ = random_weight(bits, group, n=48, k=256)
    weight = blocks.dequantize().double().numpy()
    check(ops, blocks.packed(), int(blocks.qtype), weight, torch.bfloat16)


def test_the_parts_take_int8_rows_by_their_types_bit(ops) -> None:  # type: ignore[no-untyped-def]
    """linear_quant_parts with A8_BIT on the parts' types: each part's columns as linear_quant_a8 gives them
    (two types side by side); a part without the bit beside one with it is refused."""
    from worker.models.layers import A8_BIT
    from worker.quant.gguf_pack import Q

    k = 256
    first = torch.from_numpy(pack(random_blocks(Q.Q5_0, 32, k, seed=5), Q.Q5_0, (32, k)))
    second = torch.from_numpy(pack(random_blocks(Q.Q6_K, 16, k, seed=6), Q.Q6_K, (16, k)))
    flat = torch.cat([first.view(-1), second.view(-1)])
    parts = torch.tensor([[int(Q.Q5_0) | A8_BIT, 0, 32, 0], [int(Q.Q6_K) | A8_BIT, 32, 16, first.numel()]])
    x = torch.randn(5, k).bfloat16()
    y = ops.linear_quant_parts(x, flat, parts, torch.empty(0), 48)
    assert torch.equal(y[:, :32], ops.linear_quant_a8(x, first, int(Q.Q5_0), torch.empty(0), 32))
    assert torch.equal(y[:, 32:], ops.linear_quant_a8(x, second, int(Q.Q6_K), torch.empty(0), 16))
    mixed = parts.clone()
    mixed[1, 0] = int(Q.Q6_K)
    with pytest.raises(RuntimeError, match="not one for int8 activations"):
        ops.linear_quant_parts(x, flat, mixed, torch.empty(0), 48)


@pytest.mark.parametrize("kind", ["default", "int8 rows", "W8A8"])
def test_the_parts_products_refuse_parts_that_do_not_fit(ops, kind: str) -> None:  # type: ignore[no-untyped-def]
    """linear_quant_parts (the default, and with A8_BIT: int8 rows) and linear_w8a8_parts check their parts alike
    (csrc/quant_parts.h): a part past the packing or past N, parts short of N and a bias of another size are
    errors naming the product, never a read out of bounds."""
    from worker.models.layers import A8_BIT
    from worker.quant.gguf_pack import Q

    k = 128
    q8_0 = (k // 32) * 16 * 34  # a group of 16 columns: K / 32 blocks of 34 bytes each
    qtype, name, group_bytes, product = {
        "default": (int(Q.Q8_0), "linear_quant", q8_0, ops.linear_quant_parts),
        "int8 rows": (int(Q.Q8_0) | A8_BIT, "linear_a8", q8_0, ops.linear_quant_parts),
        "W8A8": (104, "linear_w8a8", (k // 64) * (128 + 16 * 64), ops.linear_w8a8_parts),
    }[kind]
    packed = torch.zeros(2 * group_bytes, dtype=torch.uint8)
    x = torch.randn(2, k).bfloat16()
    none = torch.empty(0)
    assert product(x, packed, torch.tensor([[qtype, 0, 32, 0]]), none, 32).shape == (2, 32)
    cases = [
        (torch.tensor([[qtype, 0, 32, group_bytes]]), none, 32, "part 0 lies past the packing"),
        (torch.tensor([[qtype, 16, 32, 0]]), none, 32, "part 0 columns"),
        (torch.tensor([[qtype, 0, 16, 0]]), none, 32, "the parts cover 16 of 32 columns"),
        (torch.tensor([[qtype, 0, 32, 0]]), torch.zeros(16), 32, "bias size"),
    ]
    for parts, bias, n, message in cases:
        with pytest.raises(RuntimeError, match=f"{name}: {message}"):
            product(x, packed, parts, bias, n)
