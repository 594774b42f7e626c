"""The batch-invariant kernel a product takes by its shape (Linear.invariant_kernel): a wide product whose
width is no multiple of 64 (Whisper's logits) on the pair or AMX layout padded, against at::linear, and each
row's bits in any batch; a narrow one on csrc linear_rows."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import EXACT
from worker.models.layers import Linear


@pytest.mark.parametrize("bias", [False, True])
def test_a_wide_product_short_of_64_columns_takes_the_pair_layout_padded(ops, bias) -> None:  # type: ignore[no-untyped-def]
    """Whisper's logits (51,865 tokens) in bf16: padded with zero rows to 64 columns where the CPU has the
    pair (or AMX) kernel, linear_rows otherwise; the product's columns, and each row's bits in any batch."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(4100, 96, generator=generator).to(torch.bfloat16)
    b = torch.randn(4100, generator=generator).to(torch.bfloat16) if bias else None
    linear = Linear(96, 4100, bias=bias, dtype=torch.bfloat16)
    linear.pad_rows = True
    with torch.no_grad():
        linear.weight.copy_(weight)
        if b is not None:
            linear.bias.copy_(b)
    kind = linear.invariant_kernel(ops)
    assert kind == ("amx" if ops.has_amx() else "pairs" if ops.pairs_available() else "rows")
    linear.pack_invariant(ops)
    x = torch.randn(40, 96, generator=generator).to(torch.bfloat16)
    actual = linear(x)
    assert actual.shape == (40, 4100)
    expected = torch.nn.functional.linear(x.float(), weight.float(), b.float() if b is not None else None)
    torch.testing.assert_close(
        actual.float(), expected, atol=EXACT[torch.bfloat16], rtol=EXACT[torch.bfloat16]
    )
    alone = torch.cat([linear(x[i : i + 1]) for i in range(40)])
    assert torch.equal(actual, alone)
    narrow = Linear(96, 8, bias=False, dtype=torch.bfloat16)  # a router's 8 experts stay on linear_rows
    narrow.pad_rows = True
    assert narrow.invariant_kernel(ops) == "rows"
