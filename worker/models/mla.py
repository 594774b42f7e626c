"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent row a token, the normed
compressed KV (kv_lora_rank) and the rotated shared key (qk_rope_head_dim), instead of every head's key
and value: a layer's pool is [blocks, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]
(ModelConfig.kv_entry).

Attention runs in the absorbed form for every row, decode and prefill: kv_b_proj's key half (W_UK, per
head [nope, rank]) folds into the query, q_latent = q_nope W_UK, so that a score is q_latent . c +
q_pe . k_pe over the cached latents (the same number as transformers' q . k with k_nope = W_UK c), the
probabilities weigh the latents c themselves, and kv_b_proj's value half (W_UV) maps each head's weighted
latent to its value width. Keys are never expanded per head.

With the csrc kernels, every row (decode and prefill) is one row of paged_decode_attention over the latent
cache (its one-half layout: the key row is the value row), and the absorbed products are linear_rows per
head: each row's numbers its own, in one order, so greedy stays batch-invariant. Without them,
`latent_attention` runs in torch over the paged latent rows (a gather per decode batch, one per prefill
chunk), float32 softmax as transformers' eager attention: the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.model_config import ModelConfig
from worker.models.layers import Linear, RMSNorm
from worker.models.rope import Rope

NO_BIAS = torch.empty(0)

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup


class Weight(nn.Module):
    """A checkpoint's `<name>.weight` kept whole (not packed as a Linear's): kv_b_proj, split and absorbed."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class LatentAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.index, self.ops = index, ops
        self.tp = (
            tp  # config holds this rank's heads; every rank holds the whole latent; o's sums all-reduced
        )
        self.num_heads, self.rank = config.num_heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.scale = config.query_scale
        hidden, eps, q_width = (
            config.hidden_size,
            config.rms_norm_eps,
            self.num_heads * (self.nope + self.rope),
        )
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if config.q_lora_rank:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=config.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps, dtype, ops)
            self.q_b_proj = Linear(config.q_lora_rank, q_width, bias=False, dtype=dtype)
        else:
            self.q_proj = Linear(hidden, q_width, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(
            hidden, self.rank + self.rope, bias=config.attention_bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(self.rank, eps, dtype, ops)
        self.kv_b_proj = Weight(self.num_heads * (self.nope + self.v_dim), self.rank, dtype)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=config.attention_bias, dtype=dtype)
        for linear in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.o_proj):
            if linear is not None:  # any width takes the batch-invariant kernel (no decoder stack here)
                linear.pad_rows = True
        self.w_uk: torch.Tensor | None = None  # [heads, nope, rank], set by finalize()
        self.w_uv: torch.Tensor | None = None  # [heads, rank, v]
        self.uk_rows: list[torch.Tensor] = []  # per head, linear_rows' packing of W_UK^T and W_UV^T (csrc)
        self.uv_rows: list[torch.Tensor] = []
        self.uk_stack: torch.Tensor | None = None  # the heads' packings in one tensor (the decoder stack's)
        self.uv_stack: torch.Tensor | None = None

    def finalize(self) -> None:
        """kv_b_proj's two halves per head, in the shapes the absorbed products take."""
        weight = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk = weight[:, : self.nope].contiguous()
        self.w_uv = weight[:, self.nope :].transpose(1, 2).contiguous()
        if self.ops is not None and weight.dtype in (torch.float32, torch.bfloat16):
            ops = self.ops
            self.uk_stack = torch.stack(
                [ops.pack_rows(self.w_uk[h].t().contiguous()) for h in range(self.num_heads)]
            )
            self.uv_stack = torch.stack(
                [ops.pack_rows(self.w_uv[h].t().contiguous()) for h in range(self.num_heads)]
            )
            self.uk_rows, self.uv_rows = list(self.uk_stack.unbind(0)), list(self.uv_stack.unbind(0))

    def absorbed(
        self, x: torch.Tensor, rows: list[torch.Tensor], weight: torch.Tensor, width: int
    ) -> torch.Tensor:
        """x [n, heads, d] times each head's matrix ([heads, d, width]) -> [n, heads, width]."""
        if not rows:
            return torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)
        assert self.ops is not None
        heads = [
            self.ops.linear_rows(x[:, h].contiguous(), rows[h], NO_BIAS, width) for h in range(self.num_heads)
        ]
        return torch.stack(heads, dim=1)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        ropes: dict[str, Rope],
        kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, rank + rope]
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        assert self.w_uk is not None and self.w_uv is not None, "finalize() the model first"
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, self.nope + self.rope)
        compressed = self.kv_a_proj_with_mqa(x)  # [tokens, rank + rope]
        latent = torch.empty_like(compressed)
        latent[:, : self.rank] = self.kv_a_layernorm(compressed[:, : self.rank].contiguous())
        q_pe = q[..., self.nope :].contiguous()  # [tokens, heads, rope]
        k_pe = compressed[:, self.rank :].contiguous().view(tokens, 1, self.rope)
        q_pe, k_pe = ropes["global"].apply(q_pe, k_pe)
        latent[:, self.rank :] = k_pe[:, 0]
        kv_cache[metadata.slot_block_ids, 0, metadata.slot_offsets, 0] = latent
        if out_rows is not None:  # past the cache write, only the rows scored
            q, q_pe = q.index_select(0, out_rows), q_pe.index_select(0, out_rows)
        # the query against the latents: [rows, heads, rank + rope]
        q_nope = self.absorbed(q[..., : self.nope], self.uk_rows, self.w_uk, self.rank)  # [rows, heads, rank]
        q_latent = torch.cat([q_nope, q_pe], dim=-1)
        if self.ops is not None and kv_cache.device.type == "cpu":
            tables, lens = paged_rows(metadata, out_rows)
            attended = self.ops.paged_decode_attention(
                q_latent.contiguous(), kv_cache, tables, lens, self.scale, 0, 0.0, NO_BIAS
            )[..., : self.rank]
        else:
            attended = latent_attention(q_latent, kv_cache, metadata, self.scale, self.rank, out_rows)
        values = self.absorbed(attended, self.uv_rows, self.w_uv, self.v_dim)  # [rows, heads, v]
        out: torch.Tensor = self.o_proj(values.reshape(-1, self.num_heads * self.v_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


def paged_rows(
    metadata: AttentionMetadata, out_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table and length (its position + 1) for the paged kernel: decode rows', then each
    prefill chunk's table once a row of it; out_rows' rows (all when None), in order."""
    tables: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    if metadata.num_decode_tokens:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        tables += list(metadata.decode_block_tables)
        lens.append(metadata.decode_seq_lens)
    for chunk in metadata.prefills:
        tables += [chunk.block_ids] * (chunk.token_end - chunk.token_start)
        lens.append(
            torch.arange(chunk.context_len + 1, chunk.context_len + 1 + chunk.token_end - chunk.token_start)
        )
    width = max(len(table) for table in tables)
    table = torch.zeros(len(tables), width, dtype=torch.long)
    for i, row in enumerate(tables):
        table[i, : len(row)] = row
    seq_lens = torch.cat(lens)
    if out_rows is not None:
        table, seq_lens = table[out_rows], seq_lens[out_rows]
    return table, seq_lens


def latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    rank: int,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [rows, heads, D] against each row's cached latents [*, D] (its own written first) -> the
    probability-weighted latents' first `rank` dims, [rows, heads, rank]. out_rows: which of the step's
    rows q holds (all when None), in order."""
    width = cache.shape[-1]
    rows = torch.arange(q.shape[0]) if out_rows is None else out_rows
    position = {int(row): i for i, row in enumerate(rows.tolist())}
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    num_decode = metadata.num_decode_tokens
    decode = [i for row, i in position.items() if row < num_decode]
    if decode:
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        step_rows = torch.tensor([row for row in position if row < num_decode])
        tables, lens = metadata.decode_block_tables[step_rows], metadata.decode_seq_lens[step_rows]
        keys = cache[:, 0, :, 0][tables].view(len(decode), -1, width)  # [B, L, D]
        seen = torch.arange(keys.shape[1])[None, :] < lens[:, None]  # [B, L]
        out[decode] = _attend(q[decode], keys, seen[:, None, None, :], scale, rank)[:, :, 0]
    for chunk in metadata.prefills:
        chunk_rows = [
            (row, position[row]) for row in range(chunk.token_start, chunk.token_end) if row in position
        ]
        if not chunk_rows:
            continue
        seq_len = chunk.context_len + chunk.token_end - chunk.token_start
        keys = cache[chunk.block_ids, 0, :, 0].reshape(-1, width)[:seq_len]  # [S, D]
        at = torch.tensor([i for _, i in chunk_rows])
        query_positions = torch.tensor([chunk.context_len + row - chunk.token_start for row, _ in chunk_rows])
        seen = torch.arange(seq_len)[None, :] <= query_positions[:, None]  # [n, S]
        out[at] = _attend(q[at].transpose(0, 1)[None], keys[None], seen[None, None], scale, rank)[
            0
        ].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float, rank: int) -> torch.Tensor:
    """q [B, heads, n, D] or [B, heads, D] (one query a batch row), keys [B, S, D], seen broadcastable to
    [B, heads, n, S] -> [B, heads, n, rank]: transformers' eager attention (scores scaled, masked, a float32
    softmax cast back to q's dtype, then the values: the latents' first `rank` dims)."""
    if q.dim() == 3:
        q = q[:, :, None]
    scores = torch.matmul(q, keys[:, None].transpose(-1, -2)) * scale  # [B, heads, n, S]
    scores = scores.masked_fill(~seen, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, keys[:, None, :, :rank])
