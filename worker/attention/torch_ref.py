"""Reference paged attention in plain torch: the oracle every faster backend is tested against.

A layer may ask for a sliding window (`window` > 0: a query at position p sees keys p - window < k <= p,
as Hugging Face's sliding masks), for soft-capped scores (`softcap` > 0: s -> softcap * tanh(s /
softcap) before the softmax, Gemma 2's) and for attention sinks (a logit per head in the softmax's sum,
with no value: gpt-oss's); the last two run Hugging Face's eager attention, which SDPA cannot express.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata, PrefillChunk


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata)
        num_decode = metadata.num_decode_tokens
        if num_decode == query.shape[0]:  # decode only: no output to assemble
            return self.decode(query, kv_cache, metadata, scale, window, softcap, sinks)
        output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if num_decode:
            output[:num_decode] = self.decode(
                query[:num_decode], kv_cache, metadata, scale, window, softcap, sinks
            )
        self.prefill(query, key, value, kv_cache, metadata, scale, output, window, softcap, sinks)
        return output

    def paged_rows(
        self, metadata: AttentionMetadata, num_tokens: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block tables and lengths with one paged-kernel row per token, where a backend runs every token
        of this step that way (the csrc backend); the reference has no such kernel."""
        return None

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        kv_cache[metadata.slot_block_ids, 0, metadata.slot_offsets] = key
        kv_cache[metadata.slot_block_ids, 1, metadata.slot_offsets] = value

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
        """query: [num_decode, num_heads, head_dim], one token per sequence -> same shape."""
        assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        tables = metadata.decode_block_tables  # [B, max_blocks]
        num_seqs, max_blocks = tables.shape
        length = max_blocks * kv_cache.shape[2]
        # One gather per cache half; the result is contiguous, so the view to [B, L, ...] is free.
        k = (
            kv_cache[:, 0][tables].view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
        )  # [B, kvh, L, d]
        v = kv_cache[:, 1][tables].view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
        mask = metadata.scratch.get(("decode_mask", window))
        if mask is None:  # the first layer builds it; [B, 1, 1, L]: the keys each sequence sees
            seq_lens = metadata.decode_seq_lens
            keys = torch.arange(length, device=seq_lens.device)[None, :]
            mask = keys < seq_lens[:, None]
            if window:
                mask &= keys >= seq_lens[:, None] - window
            mask = metadata.scratch[("decode_mask", window)] = mask[:, None, None, :]
        if softcap or sinks is not None:
            return eager_attention(query.unsqueeze(2), k, v, mask, scale, softcap, sinks).squeeze(2)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, num_heads, 1, head_dim]
        return out.squeeze(2)

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
        """Each prefill chunk attends to its cached context and, causally, to itself; writes into output."""
        for chunk in metadata.prefills:
            if window or softcap or sinks is not None:
                self.prefill_chunk_eager(query, kv_cache, chunk, scale, output, window, softcap, sinks)
            else:
                self.prefill_chunk(query, key, value, kv_cache, chunk, scale, output)

    def prefill_chunk(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        start, end = chunk.token_start, chunk.token_end
        q = query[start:end].transpose(0, 1)  # [num_heads, n, head_dim]
        if chunk.context_len == 0:
            k = key[start:end].transpose(0, 1)  # [kv_heads, n, head_dim]
            v = value[start:end].transpose(0, 1)
        else:
            k, v = (part.transpose(0, 1) for part in chunk_keys_values(kv_cache, chunk))  # [kvh, S, d]
        # NOTE: 4-d inputs: CPU SDPA takes its flash kernel only for [batch, heads, seq, dim].
        out = F.scaled_dot_product_attention(
            q[None],
            k[None],
            v[None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )[0]  # [num_heads, n, head_dim]
        output[start:end] = out.transpose(0, 1)

    def prefill_chunk_eager(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        output: torch.Tensor,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """A chunk of a layer with a window, soft-capping or sinks: Hugging Face's eager attention over
        the chunk's keys and values read back from the cache (its own written first)."""
        start, end = chunk.token_start, chunk.token_end
        k, v = (part.transpose(0, 1)[None] for part in chunk_keys_values(kv_cache, chunk))  # [1, kvh, S, d]
        q = query[start:end].transpose(0, 1)[None]  # [1, heads, n, d]
        out = eager_attention(q, k, v, window_mask(chunk, window)[None, None], scale, softcap, sinks)
        output[start:end] = out[0].transpose(0, 1)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's eager attention: q [B, heads, n, d], k/v [B, kv_heads, S, d], mask bool
    broadcastable to [B, heads, n, S] (True: seen) -> [B, heads, n, d]. Scores scaled, soft-capped when
    softcap > 0, masked, then a float32 softmax cast back to q's dtype before the values; sinks
    [heads]: one more logit per head in the softmax, whose probability is dropped (gpt-oss)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, heads, n, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # [B, heads, n, S + 1], the sink last
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        return torch.matmul(probs, v)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def window_mask(chunk: PrefillChunk, window: int) -> torch.Tensor:
    """[n, seq_len] bool: query i (position context_len + i) sees keys p - window < k <= p (window 0: all
    keys up to p)."""
    n, device = chunk.token_end - chunk.token_start, chunk.block_ids.device
    keys = torch.arange(chunk.context_len + n, device=device)[None, :]
    positions = (chunk.context_len + torch.arange(n, device=device))[:, None]
    mask = keys <= positions
    return mask & (keys > positions - window) if window else mask


def chunk_keys_values(kv_cache: torch.Tensor, chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's keys and values from the cache, its context and itself: [seq_len, kv_heads, head_dim]
    each (the chunk's own are written before attention reads them)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    seq_len = chunk.context_len + chunk.token_end - chunk.token_start
    blocks = kv_cache[chunk.block_ids]  # [num_blocks, 2, block_size, kv_heads, head_dim]
    keys = blocks[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, blocks[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
