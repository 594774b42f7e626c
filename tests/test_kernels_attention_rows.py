"""Decode attention's rows (csrc paged_decode_attention) are batch-invariant: a row's bits do not depend on the
rows beside it or the thread count (docs/batch-invariance.md), as tests/test_kernels.py checks the products'."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import NO_SINKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (5, 1, 128), (4, 1, 256), (9, 3, 64)]
)
def test_paged_decode_rows_have_the_same_bits_alone_and_in_a_batch(
    ops, dtype, threads, num_heads, num_kv_heads, head_dim
) -> None:  # type: ignore[no-untyped-def]
    """A decode row alone (with one kv head: fewer tasks than threads, each group split in halves) gives the
    bits it gives among others, at any thread count (batch-invariant greedy: docs/batch-invariance.md). The
    register-blocked kernel and its halves run on AVX-512 CPUs (Zen 4, Xeon); an AVX2 build takes the
    portable loop for every row, where this holds by construction."""
    generator = torch.Generator().manual_seed(num_heads + head_dim)
    block_size, num_seqs = 16, 6
    cache = torch.randn(64, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor([70, 1, 33, 16, 101, 9])
    tables = torch.randperm(64, generator=generator)[: num_seqs * 7].view(num_seqs, 7)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = ops.paged_decode_attention(query, cache, tables, seq_lens, scale, 0, 0.0, NO_SINKS)
        for i in range(num_seqs):
            alone = ops.paged_decode_attention(
                query[i : i + 1].contiguous(), cache, tables[i : i + 1].contiguous(), seq_lens[i : i + 1],
                scale, 0, 0.0, NO_SINKS,
            )  # fmt: skip
            assert torch.equal(alone[0], batch[i]), i
    finally:
        torch.set_num_threads(before)
