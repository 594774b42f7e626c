"""CUDA graphs for decode steps: one graph per capture size (worker/gpu/graphs.py), captured at start and
replayed with the step padded to the next captured size.

A graph replays the kernels it captured on the tensors it captured, so a decode step's inputs go into static
buffers: token ids, positions and each row's KV slot, the rows past the step's being padding. Padding rows
write their keys and values into a scratch block, one past the engine's pool (the engine never hands it out),
and attend to that block alone; their logits are dropped. Each size has a FlashInfer decode wrapper in its
CUDA-graph mode (a fixed batch; plans land in our device buffers, which the graph reads), planned on the host
before each replay, as vLLM does (flashinfer-python 0.7.4, decode.py: plan() is not captured, run() is).

Graphs are captured when the backend is FlashInfer, the worker is one rank (NCCL collectives are not captured
yet), and neither --enforce-eager nor --max-cudagraph-capture-size 0 turns them off; decode_graph_sizes says
which, and the log says why not.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from worker.attention.base import AttentionMetadata
from worker.attention.flashinfer_meta import decode_plan, empty_plan, pad_decode_plan
from worker.gpu.graphs import capture_sizes, padded_size
from worker.input_batch import StepInputs

logger = logging.getLogger("engine.worker")


def decode_graph_sizes(config: Any, backend: Any, tensor_parallel_size: int) -> list[int]:
    """The decode batch sizes this CUDA worker captures ([] when graphs are off, with a log line saying why)."""
    why = None
    if config.enforce_eager:
        why = "--enforce-eager"
    elif config.max_cudagraph_capture_size == 0:
        why = "--max-cudagraph-capture-size 0"
    elif getattr(backend, "name", None) != "flashinfer":
        why = f"the {getattr(backend, 'name', 'torch')} attention backend has no graph-mode plan (FlashInfer's has)"
    elif tensor_parallel_size > 1:
        why = "tensor-parallel ranks' NCCL collectives are not captured yet"
    if why is not None:
        logger.info("CUDA graphs off (%s): every decode step runs eagerly", why)
        return []
    return capture_sizes(config.max_num_seqs, config.max_cudagraph_capture_size)


class DecodeGraphs:
    """The static buffers of graphed decode steps, a FlashInfer graph-mode decode wrapper per size, and (after
    capture()) a graph per size. run() answers a step's logits, or None for a step it does not take."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], backend: Any, sizes: list[int],
                 max_model_len: int, block_size: int, scratch_block: int, device: torch.device) -> None:  # fmt: skip
        self.model, self.kv_caches, self.backend, self.sizes = model, kv_caches, backend, sizes
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        largest = sizes[-1]
        with torch.inference_mode():  # the steps that write into them run in inference mode
            self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
            self.positions = torch.zeros(largest, dtype=torch.long, device=device)
            self.slot_block_ids = torch.full((largest,), scratch_block, dtype=torch.long, device=device)
            self.slot_offsets = torch.zeros(largest, dtype=torch.long, device=device)
            # FlashInfer's plan buffers, shared by every size's wrapper (one plan and replay at a time)
            self.kv_indptr = torch.zeros(largest + 1, dtype=torch.int32, device=device)
            self.kv_indices = torch.zeros(
                largest * -(-max_model_len // block_size), dtype=torch.int32, device=device
            )
            self.kv_last_page_len = torch.ones(largest, dtype=torch.int32, device=device)
        self.wrappers = {
            size: backend.graph_decode_wrapper(self.kv_indptr[: size + 1], self.kv_indices, self.kv_last_page_len[:size])
            for size in sizes
        }  # fmt: skip
        self.graphs: dict[int, Any] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output, [size, hidden], in the graphs' pool

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a graphed step of `size` rows: views of the static buffers, and the size's
        wrapper (planned by stage()) for every layer."""
        metadata = AttentionMetadata(
            num_decode_tokens=size, slot_block_ids=self.slot_block_ids[:size], slot_offsets=self.slot_offsets[:size]
        )  # fmt: skip
        metadata.scratch["flashinfer"] = (self.wrappers[size], None)
        return metadata

    def forward(self, size: int) -> torch.Tensor:
        """What the graph of `size` captures: the model over the static buffers' first `size` rows -> [size,
        hidden]. The logits are not in the graph (as in vLLM): a [size, vocab] output per size would stay
        allocated (2.7 GB at 512 sizes' rows of a 128k vocabulary), and the padding rows need none."""
        return self.model(  # type: ignore[no-any-return]
            self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata(size), self.backend
        )

    def stage(self, inputs: StepInputs, size: int) -> None:
        """A decode step of n <= size rows (host tensors) into the static buffers, rows n..size padding in the
        scratch block, and the size's wrapper planned. The padding rows' token ids and positions are whatever
        the buffers held (valid ones), their outputs dropped."""
        metadata, n = inputs.metadata, len(inputs.input_ids)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_block_ids[:n].copy_(metadata.slot_block_ids, non_blocking=True)
        self.slot_block_ids[n:size].fill_(self.scratch_block)
        self.slot_offsets[:n].copy_(metadata.slot_offsets, non_blocking=True)
        self.slot_offsets[n:size].zero_()
        if n:
            assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
            plan = decode_plan(metadata.decode_block_tables, metadata.decode_seq_lens, self.block_size)
        else:
            plan = empty_plan()
        self.backend.plan_decode(self.wrappers[size], pad_decode_plan(plan, size, self.scratch_block))

    def takes(self, inputs: StepInputs) -> int | None:
        """The captured size a step runs at; None for a step with prefill rows or larger than every size."""
        metadata, n = inputs.metadata, len(inputs.input_ids)
        if metadata.prefills or metadata.num_decode_tokens != n or not n:
            return None
        return padded_size(n, self.sizes)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits, [n, vocab] on the device, from its size's graph; None: run it eagerly."""
        size = self.takes(inputs)
        if size is None:
            return None
        self.stage(inputs, size)
        return self.model.compute_logits(self.replay(size)[: len(inputs.input_ids)])  # type: ignore[no-any-return]

    def replay(self, size: int) -> torch.Tensor:
        """The size's hidden states: memory of the graphs' pool, which the next replay overwrites."""
        self.graphs[size].replay()
        return self.hidden[size]

    def capture(self) -> None:
        """Every size's graph, the largest first (the smaller ones reuse its memory pool), each after an eager
        warm-up on the capture's side stream (FlashInfer's kernels load, cuBLAS picks its workspace)."""
        start, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.stage(_no_rows(), size)  # every row padding: only the scratch block is written
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward(size)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[size] = self.forward(size)
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %d MiB",
            len(self.sizes), _ranges(self.sizes), time.perf_counter() - start, (free_before - free_after) >> 20,
        )  # fmt: skip


def captured_graphs(graphs: DecodeGraphs) -> DecodeGraphs | None:
    """graphs, captured; None (every decode step eager, a warning saying why) if the capture fails: a worker
    that serves eagerly rather than not at all. A fault that leaves the GPU unusable fails the next step."""
    try:
        graphs.capture()
    except (RuntimeError, ValueError) as error:  # torch's CUDA errors, FlashInfer's plan checks
        logger.warning("CUDA graph capture failed, every decode step runs eagerly: %s", error)
        torch.cuda.synchronize(graphs.device)
        torch.cuda.empty_cache()
        return None
    return graphs


def _no_rows() -> StepInputs:
    import numpy as np

    empty = np.zeros(0, dtype=np.int64)
    metadata = AttentionMetadata(
        num_decode_tokens=0, slot_block_ids=torch.zeros(0, dtype=torch.long), slot_offsets=torch.zeros(0, dtype=torch.long)
    )  # fmt: skip
    return StepInputs(
        [], empty, empty, empty, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), metadata
    )


def _ranges(sizes: list[int]) -> str:
    return (
        ", ".join(str(size) for size in sizes)
        if len(sizes) <= 6
        else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
    )
