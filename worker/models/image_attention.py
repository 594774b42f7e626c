"""Image tokens that see each other both ways (Gemma 3's language model: transformers' mask is the causal one
OR "both in the same run of image tokens", AND the window on a sliding layer).

The backend computes every row causally and writes the step's keys and values; then each run's rows are
computed again over their request's keys with the widened mask. The scheduler puts a run's remaining
tokens in one step (engine_core/encoder_room.py), so every key a run's row sees is in the cache by then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionMetadata, ImageRun, PrefillChunk
from worker.attention.torch_ref import chunk_keys_values, eager_attention


def attend_image_runs(
    query: torch.Tensor,  # [num_tokens, heads, head_dim], after rotary
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
    output: torch.Tensor,  # [num_tokens, heads, head_dim]: the causal rows, the runs' replaced in place
) -> None:
    for run in metadata.image_runs:
        chunk = next(c for c in metadata.prefills if c.token_start <= run.row_start < c.token_end)
        k, v = (part.transpose(0, 1)[None] for part in chunk_keys_values(kv_cache, chunk))  # [1, kvh, S, d]
        q = query[run.row_start : run.row_end].transpose(0, 1)[None]  # [1, heads, n, d]
        mask = run_mask(run, chunk, k.shape[2], window)[None, None]
        if softcap:
            out = eager_attention(q, k, v, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        output[run.row_start : run.row_end] = out[0].transpose(0, 1)


def run_mask(run: ImageRun, chunk: PrefillChunk, num_keys: int, window: int) -> torch.Tensor:
    """[rows, num_keys] bool: causal, or inside the run; and inside the window on a sliding layer."""
    device = chunk.block_ids.device
    first_position = chunk.context_len + run.row_start - chunk.token_start
    positions = torch.arange(first_position, first_position + run.row_end - run.row_start, device=device)[
        :, None
    ]
    keys = torch.arange(num_keys, device=device)[None, :]
    mask = (keys <= positions) | ((keys >= run.first) & (keys < run.end))
    return mask & (keys > positions - window) if window else mask
