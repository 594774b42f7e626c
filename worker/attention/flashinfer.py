"""FlashInfer paged attention on CUDA (flashinfer-python, the [cuda] extra; imported only when chosen).

One step: prepare() plans both wrappers on the host from our block tables (worker/attention/flashinfer_meta.py:
`kv_indptr`, `kv_indices`, `kv_last_page_len`, and `qo_indptr` for prefill, int32 host tensors, which the
wrappers copy to the GPU themselves), before the step's tensors move (worker/gpu/setup.py, to_device); every
layer then writes its new keys and values into the cache by slot and runs BatchDecodeWithPagedKVCacheWrapper
on the decode rows and BatchPrefillWithPagedKVCacheWrapper (causal, aligned to the end of each request's keys)
on the prefill rows. Our cache, [num_blocks, 2, block_size, num_kv_heads, head_dim] per layer, is
FlashInfer's NHD paged cache as it is. A CUDA graph's step (worker/gpu/graph_runner.py) runs a decode wrapper
of its own, made by graph_decode_wrapper and planned before each replay. Signatures: flashinfer-python 0.7.4
(decode.py, prefill.py). The kernels are verified on a GPU only (tests/gpu/, `make gpu-check`); the plans and
this module's use of them on the CPU, against a reference of the wrappers' documented semantics.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.flashinfer_meta import PagedPlan, step_plans

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommendation; one buffer, the wrappers in turn


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, scale: float | None = None) -> None:  # fmt: skip
        import flashinfer  # type: ignore[import-not-found]

        self.flashinfer = flashinfer
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.shape = (num_heads, num_kv_heads, head_dim, block_size)  # what every plan() takes after the plan
        # every layer's (ModelConfig.query_scale: worker/models/attention.py), planned with the wrappers
        self.scale = scale if scale is not None else head_dim**-0.5
        self.workspace = torch.zeros(
            WORKSPACE_BYTES, dtype=torch.uint8, device=device
        )  # zeroed: its first use
        self.decode_wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD"
        )
        self.prefill_wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD"
        )
        # NOTE: plan() fills a wrapper's pinned host buffer and queues its copy to the GPU without waiting; the
        # next plan() rewrites that buffer. A step that copies nothing back (a prefill chunk that samples no
        # token) leaves the host free to run ahead, so each plan waits for the last one's copies first.
        self.planned = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def graph_decode_wrapper(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                             kv_last_page_len: torch.Tensor) -> Any:  # fmt: skip
        """A decode wrapper in FlashInfer's CUDA-graph mode: its batch is len(kv_last_page_len), fixed, and its
        plans land in these device buffers, which a captured graph reads."""
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_cuda_graph=True, paged_kv_indptr_buffer=kv_indptr,
            paged_kv_indices_buffer=kv_indices, paged_kv_last_page_len_buffer=kv_last_page_len,
        )  # fmt: skip

    def plan_decode(self, wrapper: Any, plan: PagedPlan) -> None:
        self._after_last_plan()
        wrapper.plan(
            plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, *self.shape, pos_encoding_mode="NONE",
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )  # fmt: skip
        self._planned()

    def _after_last_plan(self) -> None:
        if self.planned is not None:
            self.planned.synchronize()  # the last plan's copies are done (not the step after them)

    def _planned(self) -> None:
        if self.planned is not None:
            self.planned.record()

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Plan the step's wrappers (on the host, before the step's tensors move to the device), for every
        layer to run; metadata.scratch["flashinfer"] holds (the decode wrapper, the prefill wrapper), None for
        a part the step lacks."""
        decode, prefill = step_plans(metadata, self.block_size)
        if decode is not None:
            self.plan_decode(self.decode_wrapper, decode)
        if prefill is not None:
            assert prefill.qo_indptr is not None
            self._after_last_plan()
            self.prefill_wrapper.plan(
                prefill.qo_indptr, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len, *self.shape,
                causal=True, pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype,
                sm_scale=self.scale,
            )  # fmt: skip
            self._planned()
        metadata.scratch["flashinfer"] = (
            self.decode_wrapper if decode is not None else None,
            self.prefill_wrapper if prefill is not None else None,
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if scale != self.scale or window or softcap or sinks is not None:  # cuda_backend(): the torch backend
            raise ValueError(
                f"FlashInfer was planned with softmax scale {self.scale}, no window and no soft-capping; a "
                f"layer asks scale {scale}, window {window}, soft-cap {softcap}, sinks {sinks is not None}"
            )
        kv_cache[metadata.slot_block_ids, 0, metadata.slot_offsets] = key
        kv_cache[metadata.slot_block_ids, 1, metadata.slot_offsets] = value
        if "flashinfer" not in metadata.scratch:
            self.prepare(
                metadata
            )  # a caller that did not plan the step (the memory profile, a test): once, here
        decode, prefill = metadata.scratch["flashinfer"]
        split = metadata.num_decode_tokens
        if prefill is None:
            return decode.run(query, kv_cache)  # type: ignore[no-any-return]
        output = torch.empty_like(query)
        if decode is not None:
            output[:split] = decode.run(query[:split], kv_cache)
        output[split:] = prefill.run(query[split:], kv_cache)
        return output

    def paged_rows(self, metadata: AttentionMetadata, num_tokens: int, block_size: int) -> None:
        return None  # no native decoder stack on CUDA
