"""FlashInfer paged attention on CUDA (flashinfer-python, the [cuda] extra; imported only when chosen).

One step: the first layer plans both wrappers from our block tables (worker/attention/flashinfer_meta.py:
`kv_indptr`, `kv_indices`, `kv_last_page_len`, and `qo_indptr` for prefill, int32), every layer writes its
new keys and values into the cache by slot and runs BatchDecodeWithPagedKVCacheWrapper on the decode rows
and BatchPrefillWithPagedKVCacheWrapper (causal, aligned to the end of each request's keys) on the
prefill rows. Our cache, [num_blocks, 2, block_size, num_kv_heads, head_dim] per layer, is FlashInfer's
NHD paged cache as it is. Signatures: flashinfer-python 0.7.4 (decode.py, prefill.py). Verified only on
a GPU (tests/gpu/, `make gpu-check`); the plan's arithmetic is verified on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.flashinfer_meta import PagedPlan, step_plans

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommendation; one buffer, the two wrappers in turn


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int) -> None:  # fmt: skip
        import flashinfer  # type: ignore[import-not-found]

        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = (
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
        )
        self.workspace = torch.zeros(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device
        )  # zeroed: its first use
        self.decode_wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD"
        )
        self.prefill_wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD"
        )

    def _device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def plan(self, metadata: AttentionMetadata, scale: float) -> tuple[PagedPlan | None, PagedPlan | None]:
        """Once a step (the first layer's call), shared by every layer through metadata.scratch."""
        plans = metadata.scratch.get("flashinfer")
        if plans is not None:
            return plans  # type: ignore[no-any-return]
        decode, prefill = step_plans(metadata, self.block_size)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        if decode is not None:
            self.decode_wrapper.plan(
                self._device(decode.kv_indptr), self._device(decode.kv_indices), self._device(decode.kv_last_page_len),
                *shape, pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale,
            )  # fmt: skip
        if prefill is not None:
            assert prefill.qo_indptr is not None
            self.prefill_wrapper.plan(
                self._device(prefill.qo_indptr), self._device(prefill.kv_indptr), self._device(prefill.kv_indices),
                self._device(prefill.kv_last_page_len), *shape, causal=True, pos_encoding_mode="NONE",
                q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale,
            )  # fmt: skip
        metadata.scratch["flashinfer"] = (decode, prefill)
        return decode, prefill

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kv_cache[metadata.slot_block_ids, 0, metadata.slot_offsets] = key
        kv_cache[metadata.slot_block_ids, 1, metadata.slot_offsets] = value
        decode, prefill = self.plan(metadata, scale)
        split = metadata.num_decode_tokens
        if prefill is None:
            return self.decode_wrapper.run(query, kv_cache)  # type: ignore[no-any-return]
        output = torch.empty_like(query)
        if decode is not None:
            output[:split] = self.decode_wrapper.run(query[:split], kv_cache)
        output[split:] = self.prefill_wrapper.run(query[split:], kv_cache)
        return output

    def paged_rows(self, metadata: AttentionMetadata, num_tokens: int, block_size: int) -> None:
        return None  # no native decoder stack on CUDA
