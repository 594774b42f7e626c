"""csrc kernels against the torch reference, across shapes and dtypes (stated tolerances)."""

from __future__ import annotations

import pytest
import torch

from worker.attention.base import AttentionMetadata
from worker.attention.csrc_ops import load_cpu_ops
from worker.attention.torch_ref import TorchAttentionBackend


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build (the torch path serves instead)")
    return ops


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16), (16, 4, 64, 32)],
)
def test_paged_decode_attention_matches_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim, block_size
) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    num_blocks, num_seqs = 128, 7
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 97, 5 * block_size])
    max_blocks = int((seq_lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks].view(
        num_seqs, max_blocks
    )
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator).to(dtype)
    key_pos = torch.arange(max_blocks * block_size)
    metadata = AttentionMetadata(
        num_decode_tokens=num_seqs,
        slot_block_ids=torch.zeros(0, dtype=torch.long),
        slot_offsets=torch.zeros(0, dtype=torch.long),
        decode_block_tables=tables,
        decode_mask=(key_pos[None] < seq_lens[:, None])[:, None, None, :],
        decode_seq_lens=seq_lens,
    )
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().decode(query.float(), cache.float(), metadata, scale)
    actual = ops.paged_decode_attention(query, cache, tables, seq_lens, scale)
    assert actual.dtype == dtype and actual.shape == query.shape
    torch.testing.assert_close(actual.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
