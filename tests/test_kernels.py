"""csrc kernels against the torch reference, across shapes and dtypes (stated tolerances)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_host_memory import mapping_of
from worker.attention.base import AttentionMetadata, PrefillChunk
from worker.attention.torch_ref import TorchAttentionBackend
from worker.host_memory import HUGE_PAGE_BYTES
from worker.models.layers import Linear, pairs_onto_huge_pages, use_pairs

NO_SINKS = torch.empty(0)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
EVERY_DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Query-head groups of 3, 1, 4 and 5; head_dim 64, 32 (portable kernel), 128 and 256 (Gemma's); blocks of 16,
# 8 and 32; one kv head (a single sequence's step splits its group in halves).
ATTENTION_SHAPES = pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16), (16, 4, 64, 32), (4, 1, 256, 16), (5, 1, 64, 16)],
)


@EVERY_DTYPE
@ATTENTION_SHAPES
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
    check_paged_rows(ops, query, cache, tables, seq_lens)


def check_paged_rows(ops, query, cache, tables, seq_lens, window=0, softcap=0.0, sinks=None) -> None:  # type: ignore[no-untyped-def]
    """The kernel's rows (one block table and length each) against the reference, row by row."""
    metadata = AttentionMetadata(
        num_decode_tokens=query.shape[0],
        slot_block_ids=torch.zeros(0, dtype=torch.long),
        slot_offsets=torch.zeros(0, dtype=torch.long),
        decode_block_tables=tables,
        decode_seq_lens=seq_lens,
    )
    scale = query.shape[-1] ** -0.5
    expected = TorchAttentionBackend().decode(
        query.float(), cache.float(), metadata, scale, window, softcap, sinks
    )
    actual = ops.paged_decode_attention(
        query, cache, tables, seq_lens, scale, window, softcap, NO_SINKS if sinks is None else sinks
    )
    assert actual.dtype == query.dtype and actual.shape == query.shape
    tolerance = TOLERANCE[query.dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


def prefill_rows(num_heads, num_kv_heads, head_dim, block_size, dtype, seed):  # type: ignore[no-untyped-def]
    """A mixed step's rows as the native decoder stack passes them: decode rows, then prefill chunks, one
    row per token with its causal length. Chunks shorter and longer than a tile (64 rows), after a cached
    context and fresh, one a single token. (query, cache, tables, seq_lens)"""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 256
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    decode_lens = [5, 3 * block_size]
    chunks = [(0, 37), (2 * block_size + 3, 20), (0, 1), (block_size, 16), (0, 2), (block_size + 5, 150)]
    width = max(
        -(-(context + n) // block_size) for context, n in chunks + [(length, 0) for length in decode_lens]
    )
    perm = torch.randperm(num_blocks, generator=generator)
    rows_tables, rows_lens = [], []
    for i, length in enumerate(decode_lens):
        rows_tables.append(perm[i * width : (i + 1) * width])
        rows_lens.append(length)
    for i, (context, n) in enumerate(chunks, start=len(decode_lens)):
        for j in range(n):
            rows_tables.append(perm[i * width : (i + 1) * width])
            rows_lens.append(context + j + 1)
    query = torch.randn(len(rows_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, cache, torch.stack(rows_tables), torch.tensor(rows_lens)


@EVERY_DTYPE
@ATTENTION_SHAPES
def test_paged_rows_of_prefill_chunks_match_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim, block_size
) -> None:  # type: ignore[no-untyped-def]
    """With the best prefill tiles this CPU has (bf16), else row by row."""
    seed = 7 * num_heads + head_dim + block_size
    check_paged_rows(ops, *prefill_rows(num_heads, num_kv_heads, head_dim, block_size, dtype, seed))


@EVERY_DTYPE
@ATTENTION_SHAPES
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (5, 0.0), (21, 0.0), (0, 1.5), (9, 3.0)])
def test_windows_and_soft_capping_match_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim, block_size, window, softcap
) -> None:  # type: ignore[no-untyped-def]
    """A sliding window (the last `window` keys of each row: within a block, across blocks, longer than
    short rows) and soft-capped scores, on decode rows and prefill chunks' rows (which then take the rows'
    path, not the tiles)."""
    seed = 3 * num_heads + head_dim + block_size + window
    rows = prefill_rows(num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    check_paged_rows(ops, *rows, window=window, softcap=softcap)
    query, cache, tables, seq_lens = rows
    few = slice(0, 3)  # fewer rows than threads' tasks: the portable kernel's path
    check_paged_rows(ops, query[few], cache, tables[few], seq_lens[few], window=window, softcap=softcap)


@pytest.fixture(params=["avx512_bf16", "amx"])
def tiles(ops, request):  # type: ignore[no-untyped-def]
    """Prefill rows as these tiles for the test, whatever this CPU's best; skipped where not available."""
    try:
        ops.use_prefill_tiles(request.param)
    except RuntimeError as error:
        pytest.skip(str(error))
    yield request.param
    ops.use_prefill_tiles("auto")


@ATTENTION_SHAPES
def test_each_kind_of_prefill_tiles_matches_reference(
    ops, tiles, num_heads, num_kv_heads, head_dim, block_size
) -> None:  # type: ignore[no-untyped-def]
    """Every tile kind the CPU runs, not only its best (AMX CPUs have AVX-512 BF16 too). The tiles round
    the probabilities to bf16, so their results differ from the rows' in the last bits: that shows
    the tiles ran (head_dim 32 and 256 have no tiled kernel: rows there)."""
    query, cache, tables, seq_lens = prefill_rows(
        num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, 3
    )
    check_paged_rows(ops, query, cache, tables, seq_lens)
    scale = head_dim**-0.5
    tiled = ops.paged_decode_attention(query, cache, tables, seq_lens, scale, 0, 0.0, NO_SINKS)
    ops.use_prefill_tiles("none")
    rows = ops.paged_decode_attention(query, cache, tables, seq_lens, scale, 0, 0.0, NO_SINKS)
    assert ops.prefill_tiles() == ""
    assert torch.equal(tiled, rows) == (head_dim in (32, 256))


def bf16_product(
    generator: torch.Generator, rows: int, out_features: int, in_features: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 product: (weight, x, bias or an empty tensor, at::linear's result in float32)."""
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else torch.empty(0)
    expected = torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None)
    return weight, x, b, expected


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 64, 200, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_pairs_matches_linear(ops, rows, bias) -> None:  # type: ignore[no-untyped-def]
    """Few-row products on the pair layout (passes of 6 rows, 64 columns a group) against at::linear in
    float32, with and without a bias; more rows than a block of passes too, groups enough that each
    thread reads the next group's weights ahead while it works on one, and odd group counts (3, 9), where
    the two threads split the middle group's passes (from 7 rows, two passes, on)."""
    if not ops.pairs_available():
        pytest.skip("the csrc kernels were built without AVX-512 BF16")
    generator = torch.Generator().manual_seed(rows + 1000 * bias)
    for out_features, in_features in ((128, 96), (192, 64), (640, 96), (576, 96)):
        weight, x, b, expected = bf16_product(generator, rows, out_features, in_features, bias)
        actual = ops.linear_pairs(x, ops.pack_pairs(weight), b)
        assert actual.dtype == torch.bfloat16 and actual.shape == (rows, out_features)
        torch.testing.assert_close(actual.float(), expected, atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.pack_pairs(torch.zeros(100, 64, dtype=torch.bfloat16))


def test_pair_weights_move_onto_huge_pages(ops) -> None:  # type: ignore[no-untyped-def]
    """finalize() moves every pair-layout weight into one buffer on huge pages; the products do not change."""
    if not use_pairs(ops):
        pytest.skip("no pair layout here (no AVX-512 BF16, or an AMX CPU)")
    generator = torch.Generator().manual_seed(7)
    linears = [Linear(96, out_features, bias=False, dtype=torch.bfloat16) for out_features in (128, 576, 64)]
    x = torch.randn(5, 96, generator=generator).to(torch.bfloat16)
    for linear in linears:
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        linear.pack(ops)
    before = [linear(x) for linear in linears]
    pairs_onto_huge_pages(linears)
    assert [torch.equal(linear(x), out) for linear, out in zip(linears, before, strict=True)] == [True] * 3
    pairs = [linear.pairs for linear in linears]
    assert pairs[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for first, second in zip(pairs[:-1], pairs[1:], strict=True):
        assert second.data_ptr() == first.data_ptr() + first.numel() * first.element_size()
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in mapping_of(pairs[0].data_ptr())["VmFlags"].split()


# ---- batch-invariant products (csrc/gemm_rows_cpu.cpp) ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_matches_linear(ops, dtype, bias) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(3)
    for rows, in_features, out_features in [
        (1, 64, 16),
        (5, 96, 40),
        (6, 576, 1536),
        (13, 200, 48),
        (100, 64, 320),
    ]:
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
        expected = torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None)
        actual = ops.linear_rows(x, ops.pack_rows(weight), b if bias else torch.empty(0), out_features)
        assert actual.dtype == dtype and actual.shape == (rows, out_features)
        tol = EXACT[dtype] * (10 if dtype == torch.float32 else 1)  # float32: K-long sums in another order
        torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_gives_each_row_the_same_bits_in_any_batch(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """A row's result does not depend on the rows beside it, their number, or the thread count (MKL's
    float32 product fails this at almost every row count: the reason for this kernel)."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(1536, 576, generator=generator).to(dtype)
    packed = ops.pack_rows(weight)
    linear = Linear(576, 1536, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    if (
        linear.invariant_kernel(ops) == "rows"
    ):  # bf16 with AVX-512 BF16 takes the pairs (or AMX) kernel instead
        linear.pack_invariant(ops)  # the model packs in Python, straight onto huge pages: the same layout
        assert linear.rows is not None and torch.equal(linear.rows, packed)
    x = torch.randn(300, 576, generator=generator).to(dtype)
    alone = torch.cat([ops.linear_rows(x[i : i + 1], packed, torch.empty(0), 1536) for i in range(300)])
    for rows in (2, 5, 6, 7, 64, 97, 300):
        batch = ops.linear_rows(x[:rows], packed, torch.empty(0), 1536)
        assert torch.equal(batch, alone[:rows]), rows
    order = torch.randperm(300, generator=generator)
    assert torch.equal(ops.linear_rows(x[order], packed, torch.empty(0), 1536), alone[order])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.linear_rows(x, packed, torch.empty(0), 1536), alone)
    finally:
        torch.set_num_threads(threads)


# ---- fused element-wise kernels (csrc/fused_cpu.cpp) against the torch layers they replace ----


def test_kernels_run_on_every_intra_op_thread(ops) -> None:  # type: ignore[no-untyped-def]
    """Built without OpenMP, every at::parallel_for in csrc runs on one thread (decode attention too)."""
    assert ops.parallel_threads() == torch.get_num_threads()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Same rounding steps as the reference: float32 differs only by summation order; half types by one
# rounding step at most where a different float32 intermediate lands on the other side of a tie.
EXACT = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = EXACT[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (33, 1000)])
def test_rms_norm_and_fused_add_match_reference(ops, dtype, rows, hidden) -> None:  # type: ignore[no-untyped-def]
    from worker.models.layers import RMSNorm

    generator = torch.Generator().manual_seed(rows * hidden)
    reference, fused = RMSNorm(hidden, 1e-5, dtype), RMSNorm(hidden, 1e-5, dtype, ops)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    reference.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    x = (3 * torch.randn(rows, hidden, generator=generator)).to(dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(dtype)
    with torch.no_grad():
        _close(fused(x), reference(x))
        expected_out, expected_residual = reference.add_and_norm(x.clone(), residual.clone())
        out, new_residual = fused.add_and_norm(x.clone(), residual.clone())
    _close(new_residual, expected_residual)
    _close(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim,interleaved", [(64, False), (48, False), (64, True), (32, True)])
def test_rotary_in_place_on_strided_qkv_views(ops, dtype, rotary_dim, interleaved) -> None:  # type: ignore[no-untyped-def]
    """Whole heads or their leading dims (partial rotary: the rest pass), rotate-half or interleaved pairs."""
    from worker.models.rope import RotaryEmbedding

    tokens, heads, kv_heads, head_dim = 11, 6, 2, 64
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, None, torch.device("cpu"), interleaved)
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 1, 2, 5, 99, 100, 101, 300, 511, 7, 8])
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # row-strided views
    expected_q, expected_k = rotary.prepare(positions, dtype).apply(q, k)
    passed = q[..., rotary_dim:].clone()
    actual_q, actual_k = rotary.prepare(positions, dtype, ops).apply(q, k)
    assert actual_q[..., rotary_dim:].equal(passed)  # a partial rotary's other dims untouched
    assert actual_q.data_ptr() == q.data_ptr()  # in place
    _close(actual_q, expected_q)
    _close(actual_k, expected_k)
    with pytest.raises(RuntimeError, match="position out of range"):
        rotary.prepare(torch.full((tokens,), 512), dtype, ops).apply(q, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    from worker.models.layers import silu_and_mul

    gate_up = (4 * torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(3))).to(dtype)
    _close(silu_and_mul(gate_up, ops), silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_index_put(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    num_blocks, block_size, kv_heads, head_dim, tokens = 10, 4, 3, 32, 6
    generator = torch.Generator().manual_seed(11)
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=generator).to(dtype)
    k, v = (t.view(tokens, kv_heads, head_dim) for t in kv.split(kv_heads * head_dim, dim=-1))
    metadata = AttentionMetadata(
        num_decode_tokens=tokens,
        slot_block_ids=torch.tensor([3, 3, 0, 9, 5, 5]),
        slot_offsets=torch.tensor([0, 3, 1, 2, 0, 1]),
    )
    expected = torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype)
    actual = expected.clone()
    TorchAttentionBackend().write_kv(k, v, expected, metadata)
    ops.write_kv(k, v, actual, metadata.slot_block_ids, metadata.slot_offsets)
    assert torch.equal(actual, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(k, v, actual, torch.full((tokens,), num_blocks), metadata.slot_offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_first_maximum(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(5))
    logits[1, 17] = logits[1, 40000] = 100.0  # ties: the first index wins, as torch.argmax
    logits[2, -1] = 100.0
    logits[3, 0] = 100.0
    logits[4] = -1e30
    logits[5, 123] = 7.0
    logits[5, 124] = 7.01  # equal once rounded to bfloat16 (the tie goes to 123), not in float32
    logits = logits.to(dtype)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(logits[:, :1000]), logits[:, :1000].argmax(dim=-1))  # row stride
    # What the sampler relies on: the bfloat16 argmax is the float32 argmax of the same values.
    assert torch.equal(ops.argmax_rows(logits), ops.argmax_rows(logits.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_columns_is_index_select_on_the_columns(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(6)).to(dtype)
    order = torch.randperm(576, generator=torch.Generator().manual_seed(7))
    view = x[:, :576]  # rows 1536 apart
    assert torch.equal(ops.gather_columns(view, order), view.index_select(1, order))
    assert torch.equal(ops.gather_columns(x[:0, :576], order), x[:0, :576])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gather_columns(view, torch.full((576,), 576))


def prefill_metadata(chunks: list[PrefillChunk]) -> AttentionMetadata:
    """A step of prefill chunks only; their KV is already in the cache."""
    empty = torch.zeros(0, dtype=torch.long)
    return AttentionMetadata(num_decode_tokens=0, slot_block_ids=empty, slot_offsets=empty, prefills=chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_plans_match_per_chunk_reference(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """The CPU backend sends short chunks through the paged kernel (one row per token), batches longer
    ones after a cached context into padded SDPA calls (several groups when PREFILL_BATCH_TOKENS is
    small) and runs the rest one by one; every plan gives the per-chunk reference's rows."""
    from worker.attention import cpu
    from worker.attention.base import PrefillChunk

    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 16, 64
    generator = torch.Generator().manual_seed(21)
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    # (context, new tokens): prefix hits of different lengths, a one-token chunk, a fresh prompt.
    shapes = [(512 - 16, 20), (37, 1), (16, 64), (0, 30), (100, 7)]
    chunks, start, next_block = [], 0, 1
    for context, n in shapes:
        used = -(-(context + n) // block_size)
        block_ids = torch.arange(next_block, next_block + used)
        next_block += used
        chunks.append(PrefillChunk(start, start + n, context, block_ids))
        start += n
    query = torch.randn(start, heads, head_dim, generator=generator).to(dtype)
    key = torch.empty(start, kv_heads, head_dim, dtype=dtype)
    value = torch.empty_like(key)
    for chunk in chunks:  # the new tokens' KV, as write_kv left it in the cache
        n = chunk.token_end - chunk.token_start
        positions = chunk.context_len + torch.arange(n)
        slots = cache[chunk.block_ids[positions // block_size], :, positions % block_size]  # [n, 2, kvh, d]
        key[chunk.token_start : chunk.token_end], value[chunk.token_start : chunk.token_end] = (
            slots[:, 0],
            slots[:, 1],
        )
    metadata = prefill_metadata(chunks)
    expected = torch.zeros_like(query)
    TorchAttentionBackend().prefill(query, key, value, cache, metadata, 0.125, expected)
    # (paged-kernel limit, batch budget) -> (paged chunks' indices, one-by-one chunks, groups' sizes)
    plans = {
        (0, cpu.PREFILL_BATCH_TOKENS): ([], [3], [4]),  # all SDPA: the fresh prompt causal, one group
        (0, 600): ([], [3], [1, 3]),  # the long chunk alone, then the rest
        (1000, cpu.PREFILL_BATCH_TOKENS): ([1, 3, 4], [], [2]),  # rows of the kernel not one run
        (cpu.PAGED_PREFILL_PAIRS, cpu.PREFILL_BATCH_TOKENS): ([0, 1, 2, 3, 4], [], []),
    }
    for (limit, budget), (paged_chunks, single_chunks, group_sizes) in plans.items():
        actual = torch.zeros_like(query)
        old_budget = cpu.PREFILL_BATCH_TOKENS
        cpu.PREFILL_BATCH_TOKENS = budget
        try:
            step = AttentionMetadata(**{**metadata.__dict__, "scratch": {}})
            backend = cpu.CpuAttentionBackend(ops, dtype)
            backend.paged_pairs = limit
            backend.prefill(query, key, value, cache, step, 0.125, actual)
        finally:
            cpu.PREFILL_BATCH_TOKENS = old_budget
        paged, singles, groups = step.scratch[("prefill_plan", limit)]
        rows = [] if paged is None else torch.arange(start)[paged.rows].tolist()
        expected_rows = [r for i in paged_chunks for r in range(chunks[i].token_start, chunks[i].token_end)]
        assert rows == expected_rows
        assert singles == [chunks[i] for i in single_chunks]
        assert [g.tables.shape[0] for g in groups] == group_sizes
        torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_over_shared_cached_blocks_matches_reference(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """Chunks after a cached context that begin with the same blocks (a shared system prompt): the
    shared keys are attended to once for all rows and merged with each chunk's own part by log-sum-exp;
    the rows equal the per-chunk reference. Fewer shared tokens than CASCADE_MIN_TOKENS: no cascade."""
    from worker.attention import cpu
    from worker.attention.base import PrefillChunk

    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 16, 96
    generator = torch.Generator().manual_seed(5)
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    min_blocks = cpu.CASCADE_MIN_TOKENS // block_size
    for shared_len, expect_cascade in ((min_blocks, True), (min_blocks - 1, False)):
        shared = torch.arange(1, 1 + shared_len)
        # (own cached tokens after the shared blocks, new tokens): one chunk right after the shared part
        shapes = [(0, 130), (20, 140), (37, 100), (5, 120)]  # each too long for the paged kernel
        chunks, start, next_block = [], 0, 1 + shared_len
        for own, n in shapes:
            context = shared_len * block_size + own
            used = -(-(context + n) // block_size) - shared_len
            block_ids = torch.cat([shared, torch.arange(next_block, next_block + used)])
            next_block += used
            chunks.append(PrefillChunk(start, start + n, context, block_ids))
            start += n
        query = torch.randn(start, heads, head_dim, generator=generator).to(dtype)
        key = torch.empty(
            start, kv_heads, head_dim, dtype=dtype
        )  # unused after a context: the cache has them
        metadata = prefill_metadata(chunks)
        expected = torch.zeros_like(query)
        TorchAttentionBackend().prefill(query, key, key, cache, metadata, 0.125, expected)
        actual = torch.zeros_like(query)
        backend = cpu.CpuAttentionBackend(ops)
        backend.prefill(query, key, key, cache, metadata, 0.125, actual)
        paged, singles, groups = metadata.scratch[("prefill_plan", backend.paged_pairs)]
        assert paged is None and singles == [] and len(groups) == 1
        if expect_cascade:
            assert groups[0].shared is not None and torch.equal(groups[0].shared, shared)
        else:
            assert groups[0].shared is None
        torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
