"""The CUDA worker's start: its attention backend, its inputs on the device, and the KV cache sized from the
device's memory after a profiling forward pass (worker/gpu/memory.py). The model runner is the CPU one's
(worker/model_runner.py), with these pieces where the device differs. Verified on a GPU only
(tests/gpu/, `make gpu-check`); the decisions in it are unit-tested on the CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import Any

import torch

from worker.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from worker.gpu.backends import choose_cuda_backend
from worker.gpu.device import DeviceError
from worker.gpu.memory import MemoryPlan, bytes_per_block, plan_kv_cache
from worker.input_batch import StepInputs
from worker.model_config import ModelConfig

logger = logging.getLogger("engine.worker")
DEFAULT_UTILIZATION = 0.9


def cuda_backend(requested: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int) -> AttentionBackend:  # fmt: skip
    """FlashInfer, else xformers, else torch's SDPA over the same cache; a log line says why not the first."""
    if config.kv_lora_rank:
        raise DeviceError("multi-head latent attention (DeepSeek-V2/V3) runs on the CPU worker only so far")
    installed = {name for name in ("flashinfer", "xformers") if importlib.util.find_spec(name) is not None}
    dtype_name = str(dtype).removeprefix("torch.")
    name, reasons = choose_cuda_backend(
        "auto" if requested in ("auto", "cpu") else requested,
        config.head_dim,
        dtype_name,
        installed,
        nvcc_found(),
    )
    if name == "flashinfer" and (config.sliding_window or config.attn_softcap or config.attention_sinks):
        # NOTE: our FlashInfer plan serves one kind of layer; a model whose layers differ (Gemma's windows
        # on some of them) needs a plan per kind, not built yet
        if requested == "flashinfer":
            raise DeviceError(
                "--attention-backend flashinfer: sliding windows, soft-capped scores and attention sinks are not "
                "planned yet"
            )
        name = "torch"
        reasons.append("sliding windows, soft-capped scores and sinks take the torch backend on CUDA so far")
    if reasons:
        logger.info("attention on CUDA: %s (%s)", name, "; ".join(reasons))
    if name == "flashinfer":
        from worker.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(
            device,
            dtype,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            block_size,
            config.query_scale,
        )
    if name == "xformers":
        from worker.attention.xformers import XformersBackend

        return XformersBackend()
    from worker.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def nvcc_found() -> bool:
    """Where FlashInfer's JIT looks for the CUDA compiler (flashinfer/jit/cpp_ext.py, 0.7.4)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def to_device(
    inputs: StepInputs, device: torch.device, backend: AttentionBackend | None = None
) -> StepInputs:
    """The step's tensors on the device (built on the host from the batch state's numpy arrays), the backend's
    plan made from them on the host first where it has one (FlashInfer's prepare)."""
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(inputs.metadata)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    groups = [inputs.metadata]
    if inputs.metadata.window_group is not None:  # a model with a pool for its windowed layers
        groups.append(inputs.metadata.window_group)
    for metadata in groups:
        metadata.slot_block_ids, metadata.slot_offsets = (
            move(metadata.slot_block_ids),
            move(metadata.slot_offsets),
        )
        if metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None:
            metadata.decode_block_tables = move(metadata.decode_block_tables)
            metadata.decode_seq_lens = move(metadata.decode_seq_lens)
        # NOTE: moved once a step, shared by the layers
        for chunk in metadata.prefills:
            chunk.block_ids = move(chunk.block_ids)
    if inputs.metadata.long_rope is not None:
        inputs.metadata.long_rope = move(inputs.metadata.long_rope)
    if inputs.metadata.prompt_lens is not None:
        inputs.metadata.prompt_lens = move(inputs.metadata.prompt_lens)
    inputs.input_ids, inputs.positions = move(inputs.input_ids), move(inputs.positions)
    return inputs


def kv_cache_plan(model: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                  num_tokens: int, num_rows: int, max_model_len: int, utilization: float | None,
                  backend: AttentionBackend) -> MemoryPlan:  # fmt: skip
    """Run one prefill of num_tokens (the step budget) and the logits of num_rows (--max-num-seqs) through the
    model with a cache that holds just them, measure the peak, and give the KV cache what is left."""
    num_blocks = -(-num_tokens // block_size)
    caches = [torch.zeros((num_blocks, 2, block_size, config.num_kv_heads, config.head_dim), dtype=dtype,
                          device=device) for _ in range(config.num_layers)]  # fmt: skip
    positions = torch.arange(num_tokens, device=device)
    metadata = AttentionMetadata(
        num_decode_tokens=0, slot_block_ids=positions // block_size, slot_offsets=positions % block_size,
        prefills=[PrefillChunk(0, num_tokens, 0, torch.arange(num_blocks, device=device))],
    )  # fmt: skip
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        hidden = model(
            torch.zeros(num_tokens, dtype=torch.long, device=device), positions, caches, metadata, backend
        )
        model.compute_logits(hidden[-min(num_rows, num_tokens) :]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, hidden, metadata
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # in use now (weights, this process's runtime, other processes) plus the activations' peak above it
    used = total - free + max(0, peak - torch.cuda.memory_allocated(device))
    plan = plan_kv_cache(
        total, utilization or DEFAULT_UTILIZATION, used,
        bytes_per_block(block_size, config.num_kv_heads, config.head_dim, config.num_layers, dtype.itemsize),
        min_blocks=-(-max_model_len // block_size),
    )  # fmt: skip
    logger.info("%s", plan.describe())
    return plan
