"""The fast CPU backend: decode attention by the csrc kernel, reading blocks in place (no gather), and
new keys and values written into the cache by one kernel call.

Prefill: in bf16 on a CPU with AVX-512 BF16 (and so on every CPU with AMX), every chunk goes through the
same paged kernel, one query row per token with its causal length, all in one call; the kernel runs a
chunk's rows as tiles that read their keys once, the products on AMX where the CPU has it, else as
AVX-512 BF16 dot products. Otherwise (float32, other CPUs) short chunks (fresh prompts of a few hundred
tokens, short continuations of a cached context) take that path row by row; longer chunks after a
cached context are batched into padded SDPA calls (with a shared cached prefix attended once for all of
them), longer fresh ones use SDPA's causal path one by one. `ops` (the csrc module) is public: the
model's fused layers use the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from worker.attention.base import AttentionMetadata, PrefillChunk
from worker.attention.torch_ref import TorchAttentionBackend

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps

# Padded keys (chunks x longest block table x block size) one batched prefill call may gather.
PREFILL_BATCH_TOKENS = 64 * 1024
# Chunks after a cached context that all begin with the same cached blocks (a shared system prompt, the
# same document) of at least this many tokens attend to those keys in one call for all their query rows
# (cascade attention: the shared part and each chunk's own part apart, merged by their log-sum-exps).
CASCADE_MIN_TOKENS = 128
# A chunk goes through the paged kernel when its query-key pairs, new tokens x (context + half of
# them), are at most this many: the kernel reads each pair's key once, without a gather, a mask or a
# matrix-product blocking; SDPA wins on longer ones. Measured (bf16, 30 layers, 2 threads): 16 fresh
# prompts of ~100 tokens 97 vs 198 ms; 4 x 16 new after 512 cached 21 vs 36 ms; 4 fresh x 200 even;
# 4 x 128 after 128 even; 4 fresh x 300: 163 vs 108 ms.
PAGED_PREFILL_PAIRS = 16 * 1024
# The same limit where the kernel runs a chunk's rows as tiles (bf16; csrc `prefill_tiles`: "amx" or
# "avx512_bf16"): each tile of up to 64 rows reads its keys once. It wins or ties at every length
# measured, so every chunk takes it. Whole in-process steps against the SDPA paths, alternating:
# with AMX (Xeon, 2026-11-30): 15 x 64 new after 512 shared 315 vs 426 ms; 2 fresh x 1024 689 vs 823;
# one fresh 2,000-token prompt 1173 vs 1150; a 6,000-token prompt in 2,048-token chunks 5.0 vs 7.3 s.
# With AVX-512 BF16 (EPYC, no AMX, 2026-11-30 16:00): the shared-prefix wave's 256-token steps 181-189 vs
# 283-292 ms; 2 fresh x 1024 1365 vs 1932 ms; one fresh 2,000-token prompt 1563 vs 2408 ms; 4,000 in
# two chunks 3959 vs 8096 ms; 16 fresh x 100 896 vs 913 ms
# (benchmarks/results/2026-11-29-lab-notes-performance.md, "On a CPU without AMX").
TILED_PREFILL_PAIRS = 1 << 62


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, ops: CpuOps, dtype: torch.dtype | None = None, batch_invariant: bool = False) -> None:
        self.ops = ops
        self.batch_invariant = batch_invariant
        if batch_invariant:
            # NOTE: every row, decode or prefill, is one paged-kernel row: one task computes each (row,
            # head) over its keys in one order, whatever the batch. No tiles: a tile weighs values in bf16
            # where a row does in float32, and which rows share a tile depends on how the prompt was
            # chunked (a chunk's last row alone takes the row path). The tile choice is the process's.
            ops.use_prefill_tiles("none")
            self.paged_pairs = TILED_PREFILL_PAIRS
            return
        tiled = dtype == torch.bfloat16 and bool(ops.use_prefill_tiles("auto"))
        self.paged_pairs = TILED_PREFILL_PAIRS if tiled else PAGED_PREFILL_PAIRS

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        self.ops.write_kv(key, value, kv_cache, metadata.slot_block_ids, metadata.slot_offsets)

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        return self.ops.paged_decode_attention(
            query.contiguous(),
            kv_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            scale,
            window,
            softcap,
            _sinks(sinks),
        )

    def paged_rows(
        self, metadata: AttentionMetadata, num_tokens: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block tables, lengths) with one paged-kernel row per token, when every token of the step goes
        through that kernel (decode, short prefill chunks); None when some chunk needs SDPA."""
        if not metadata.prefills:
            assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
            return metadata.decode_block_tables, metadata.decode_seq_lens
        paged, singles, groups = step_plan(metadata, block_size, self.paged_pairs)
        num_decode = metadata.num_decode_tokens
        if paged is None or singles or groups:
            return None
        if not isinstance(paged.rows, slice) or paged.rows != slice(num_decode, num_tokens):
            return None  # the paged rows are not all the tokens after the decode rows
        if not num_decode:
            return paged.tables, paged.seq_lens
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        decode_tables = metadata.decode_block_tables
        width = max(decode_tables.shape[1], paged.tables.shape[1])
        tables = torch.zeros(num_tokens, width, dtype=torch.long)
        tables[:num_decode, : decode_tables.shape[1]] = decode_tables
        tables[num_decode:, : paged.tables.shape[1]] = paged.tables
        return tables, torch.cat([metadata.decode_seq_lens, paged.seq_lens])

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """A layer with a window, soft-capping or sinks: every chunk's rows through the paged kernel (each row
        reads its window's keys alone). Otherwise, short chunks: one paged-kernel call, a query row per token (16 fresh prompts of ~100 tokens
        took 198 ms in 480 SDPA calls a step, 97 ms this way). Longer chunks after a cached context
        (prefix-cache hits, later chunks of long prompts), when there are several: batched SDPA calls
        over their KV read back from the cache (the new tokens are already written), one call per group
        instead of one per chunk; when they all begin with the same cached blocks, those keys are
        attended to once for all their rows (cascade, merged by log-sum-exp). The rest: SDPA per chunk."""
        every_row = bool(window or softcap) or sinks is not None
        paged, singles, groups = step_plan(
            metadata, kv_cache.shape[2], TILED_PREFILL_PAIRS if every_row else self.paged_pairs
        )
        if paged is not None:
            rows = paged.rows
            out = self.ops.paged_decode_attention(
                query[rows].contiguous(), kv_cache, paged.tables, paged.seq_lens, scale, window, softcap,
                _sinks(sinks),
            )  # fmt: skip
            output[rows] = out
        for chunk in singles:
            self.prefill_chunk(query, key, value, kv_cache, chunk, scale, output)
        for group in groups:
            k, v = _gather_keys(kv_cache, group.tables)  # [B, kvh, S, d]
            q = query[group.rows].transpose(1, 2)  # [B, heads, n, d]
            mask = group.additive_mask(query.dtype)
            if group.shared is None:
                out, _ = _flash(q, k, v, mask, scale)  # [B, heads, n, d]
                output[group.valid_rows] = out.transpose(1, 2)[group.valid]
                continue
            # Cascade: every row against the shared keys in one call, then against its own chunk's keys.
            shared_k, shared_v = _gather_keys(kv_cache, group.shared[None])  # [1, kvh, P, d]
            rows = query[group.valid_rows].transpose(0, 1)[None]  # [1, heads, N, d]
            shared_out, shared_lse = _flash(rows, shared_k, shared_v, None, scale)
            own_out, own_lse = _flash(q, k, v, mask, scale)  # [B, heads, n, d], [B, heads, n]
            own_out = own_out.transpose(1, 2)[group.valid]  # [N, heads, d]
            own_lse = own_lse.transpose(1, 2)[group.valid]  # [N, heads]
            shared_out, shared_lse = shared_out[0].transpose(0, 1), shared_lse[0].transpose(0, 1)
            top = torch.maximum(shared_lse, own_lse)
            shared_w, own_w = (shared_lse - top).exp_(), (own_lse - top).exp_()  # [N, heads]
            merged = shared_out.float() * shared_w[..., None] + own_out.float() * own_w[..., None]
            output[group.valid_rows] = (merged / (shared_w + own_w)[..., None]).to(query.dtype)


def _gather_keys(kv_cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of [B, num_blocks] block tables, as [B, kv_heads, num_blocks * block_size, d]."""
    batch, num_kv_heads, head_dim = tables.shape[0], kv_cache.shape[3], kv_cache.shape[4]
    blocks = kv_cache[tables]  # [B, num_blocks, 2, block_size, kv_heads, head_dim]
    keys = blocks[:, :, 0].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = blocks[:, :, 1].reshape(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    return keys, values


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel (what F.scaled_dot_product_attention runs here, GQA included), which also
    returns each row's log-sum-exp of its scaled scores: q [B, heads, n, d], k/v [B, kvh, S, d], an
    additive mask in q's dtype -> ([B, heads, n, d], float32 [B, heads, n])."""
    out_and_lse: tuple[torch.Tensor, torch.Tensor] = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    )
    return out_and_lse


@dataclass
class PrefillGroup:
    tables: torch.Tensor  # [B, max_blocks] block ids, padded with block 0 (masked out)
    keys_len: int  # max_blocks * block_size
    rows: torch.Tensor  # [B, n] each chunk's query rows, padded with its first row (results dropped)
    mask: torch.Tensor  # [B, 1, n, keys_len] query i of chunk b sees keys 0..context_b + i
    valid: torch.Tensor  # [B, n] bool: real query rows
    valid_rows: torch.Tensor  # [num valid] their rows in the step's flattened tokens
    # The cached blocks every chunk of the step begins with (cascade), or None; tables and mask then
    # cover the keys after them.
    shared: torch.Tensor | None = None
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as the flash kernel takes it (0 or -inf in the query's dtype), built once a step."""
        if dtype not in self._additive:
            mask = torch.zeros(self.mask.shape, dtype=dtype)
            self._additive[dtype] = mask.masked_fill_(~self.mask, float("-inf"))
        return self._additive[dtype]


@dataclass
class PagedPrefill:
    """Short chunks as rows of the paged decode kernel: one row per query token."""

    rows: slice | torch.Tensor  # the tokens' rows in the step (a slice when they are one run)
    tables: torch.Tensor  # [num rows, max_blocks] each row's block table (its chunk's), padded with 0
    seq_lens: torch.Tensor  # [num rows] keys each row sees: its chunk's context + its index + 1


def step_plan(
    metadata: AttentionMetadata, block_size: int, paged_pairs: int
) -> tuple[PagedPrefill | None, list[PrefillChunk], list[PrefillGroup]]:
    """plan_prefill of the step's chunks, made on first use (the first layer) and shared by the rest (by
    the layers of each kind, when a model's windowed layers take every chunk as paged rows)."""
    key = ("prefill_plan", paged_pairs)
    plan = metadata.scratch.get(key)
    if plan is None:
        plan = metadata.scratch[key] = plan_prefill(metadata.prefills, block_size, paged_pairs)
    return cast(tuple[PagedPrefill | None, list[PrefillChunk], list[PrefillGroup]], plan)


def plan_prefill(
    chunks: list[PrefillChunk], block_size: int, paged_pairs: int = PAGED_PREFILL_PAIRS
) -> tuple[PagedPrefill | None, list[PrefillChunk], list[PrefillGroup]]:
    """(short chunks for the paged kernel, chunks prefilled one by one, batched groups). Fresh chunks too
    long for the kernel keep SDPA's causal path one call each (no mask to build); chunks after a context
    are batched when there are several."""
    short: list[PrefillChunk] = []
    rest: list[PrefillChunk] = []
    for chunk in chunks:
        (short if _pairs(chunk) <= paged_pairs else rest).append(chunk)
    paged = _plan_paged(short) if short else None
    with_context = [chunk for chunk in rest if chunk.context_len > 0]
    if len(with_context) < 2:
        return paged, rest, []
    fresh = [chunk for chunk in rest if chunk.context_len == 0]
    return paged, fresh, plan_prefill_groups(with_context, block_size)


def _pairs(chunk: PrefillChunk) -> int:
    n = chunk.token_end - chunk.token_start
    return n * chunk.context_len + n * (n + 1) // 2


def _plan_paged(chunks: list[PrefillChunk]) -> PagedPrefill:
    lengths = [c.token_end - c.token_start for c in chunks]
    total = sum(lengths)
    tables = torch.zeros(total, max(int(c.block_ids.numel()) for c in chunks), dtype=torch.long)
    seq_lens = torch.empty(total, dtype=torch.long)
    row, one_run = 0, True
    for chunk, n in zip(chunks, lengths, strict=True):
        tables[row : row + n, : chunk.block_ids.numel()] = chunk.block_ids
        seq_lens[row : row + n] = torch.arange(chunk.context_len + 1, chunk.context_len + n + 1)
        one_run = one_run and chunk.token_start == chunks[0].token_start + row
        row += n
    if one_run:
        first = chunks[0].token_start
        return PagedPrefill(slice(first, first + total), tables, seq_lens)
    rows = torch.cat([torch.arange(c.token_start, c.token_end) for c in chunks])
    return PagedPrefill(rows, tables, seq_lens)


def plan_prefill_groups(chunks: list[PrefillChunk], block_size: int) -> list[PrefillGroup]:
    """Chunks batched in order, each group's padded keys (B x longest table) at most PREFILL_BATCH_TOKENS.
    When they all begin with the same cached blocks, CASCADE_MIN_TOKENS or more, those are left out of
    the tables and attended to once for all rows (`PrefillGroup.shared`)."""
    shared = shared_blocks(chunks, block_size)
    if shared is not None:
        skip = int(shared.numel())
        chunks = [
            PrefillChunk(c.token_start, c.token_end, c.context_len - skip * block_size, c.block_ids[skip:])
            for c in chunks
        ]
    groups: list[list[PrefillChunk]] = [[]]
    widest = 0
    for chunk in chunks:
        blocks = int(chunk.block_ids.numel())
        if groups[-1] and (len(groups[-1]) + 1) * max(widest, blocks) * block_size > PREFILL_BATCH_TOKENS:
            groups.append([])
            widest = 0
        groups[-1].append(chunk)
        widest = max(widest, blocks)
    planned = [_plan_group(group, block_size) for group in groups]
    for group in planned:
        group.shared = shared
    return planned


def shared_blocks(chunks: list[PrefillChunk], block_size: int) -> torch.Tensor | None:
    """The leading block ids all chunks have in common within their cached context, when there are at
    least CASCADE_MIN_TOKENS in them; else None."""
    min_blocks = -(-CASCADE_MIN_TOKENS // block_size)
    common = min(c.context_len for c in chunks) // block_size
    first = chunks[0].block_ids[:common]
    for chunk in chunks[1:]:
        if common < min_blocks:
            break
        differ = (chunk.block_ids[:common] != first[:common]).nonzero()
        if differ.numel():
            common = int(differ[0])
    return first[:common] if common >= min_blocks else None


def _plan_group(chunks: list[PrefillChunk], block_size: int) -> PrefillGroup:
    batch = len(chunks)
    lengths = [c.token_end - c.token_start for c in chunks]
    longest = max(lengths)
    max_blocks = max(int(c.block_ids.numel()) for c in chunks)
    tables = torch.zeros(batch, max_blocks, dtype=torch.long)
    rows = torch.zeros(batch, longest, dtype=torch.long)
    for b, chunk in enumerate(chunks):
        tables[b, : chunk.block_ids.numel()] = chunk.block_ids
        rows[b] = chunk.token_start
        rows[b, : lengths[b]] = torch.arange(chunk.token_start, chunk.token_end)
    context = torch.tensor([c.context_len for c in chunks])
    keys_len = max_blocks * block_size
    limit = context[:, None] + torch.arange(longest)[None, :]  # [B, n] each query's position
    mask = torch.arange(keys_len)[None, None, :] <= limit[:, :, None]  # [B, n, S]
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [B, n]
    return PrefillGroup(tables, keys_len, rows, mask.unsqueeze(1), valid, rows[valid])


NO_SINKS = torch.empty(0)


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor:
    """What paged_decode_attention takes: the sinks in float32, or an empty tensor for none."""
    return NO_SINKS if sinks is None else sinks.float()
