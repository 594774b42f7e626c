"""csrc linear_amx (csrc/gemm_amx_cpu.cpp), the batch-invariant bf16 product of a CPU with AMX, against
at::linear, and a row's bits in any batch. Every test skips, saying why, on a CPU without AMX."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import bf16_product
from worker.models.layers import Linear

NO_AMX = "linear_amx runs on a CPU with AMX only (an Intel Xeon from Sapphire Rapids on); this one has none"


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 33, 64, 200, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_amx_matches_linear(ops, rows, bias) -> None:  # type: ignore[no-untyped-def]
    """AMX products against at::linear in float32: one tile of rows, two (32 x 32 units), a last tile of
    fewer than 16 rows, odd column-block counts, K of one and of many 32-dim steps; the 5-d view
    decoder_layers passes gives the same bits."""
    if not ops.has_amx():
        pytest.skip(NO_AMX)
    generator = torch.Generator().manual_seed(rows + 1000 * bias)
    for out_features, in_features in ((128, 96), (192, 64), (576, 576), (64, 1536)):
        weight, x, b, expected = bf16_product(generator, rows, out_features, in_features, bias)
        packed = ops.pack_pairs(weight)
        actual = ops.linear_amx(x, packed, b)
        assert actual.dtype == torch.bfloat16 and actual.shape == (rows, out_features)
        torch.testing.assert_close(actual.float(), expected, atol=1e-2, rtol=1e-2)
        groups, kpairs, width, two = packed.shape
        viewed = packed.view(groups, kpairs // 16, 16, width, two)
        assert torch.equal(ops.linear_amx(x, viewed, b), actual)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_amx(
            torch.zeros(2, 80, dtype=torch.bfloat16),
            ops.pack_pairs(torch.zeros(64, 80, dtype=torch.bfloat16)),
            torch.empty(0),
        )


def test_linear_amx_gives_each_row_the_same_bits_in_any_batch(ops) -> None:  # type: ignore[no-untyped-def]
    """A row's AMX product does not depend on the rows beside it, their number (one tile, two, a part
    tile), their order or the thread count; and it is the product a bf16 Linear takes in invariant mode
    on this CPU, in Python and through decoder_layers' 5-d view."""
    if not ops.has_amx():
        pytest.skip(NO_AMX)
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(1536, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(1536, generator=generator).to(torch.bfloat16)
    linear = Linear(576, 1536, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    assert linear.invariant_kernel(ops) == "amx"
    linear.pack_invariant(ops)
    packed = linear.pairs
    assert linear.amx and packed is not None and torch.equal(packed, ops.pack_pairs(weight))
    x = torch.randn(300, 576, generator=generator).to(torch.bfloat16)
    alone = torch.cat([ops.linear_amx(x[i : i + 1], packed, bias) for i in range(300)])
    for rows in (2, 15, 16, 17, 32, 33, 64, 97, 300):
        assert torch.equal(ops.linear_amx(x[:rows], packed, bias), alone[:rows]), rows
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    order = torch.randperm(300, generator=generator)
    assert torch.equal(ops.linear_amx(x[order], packed, bias), alone[order])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.linear_amx(x, packed, bias), alone)
    finally:
        torch.set_num_threads(threads)
