"""`--quantization`, as vLLM spells it: what the checkpoint says (a GGUF file's tensor types, a folder's
`quantization_config`) unless the flag says otherwise; a flag that contradicts the checkpoint is a start
error, and `none` dequantizes a GGUF file's weights to the model's dtype at load (as before packing)."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from worker.model_config import UnsupportedModelError

if TYPE_CHECKING:
    from protocol.config import WorkerConfig

logger = logging.getLogger("engine.worker")

METHODS = ("gguf", "awq", "gptq", "compressed-tensors", "none")
NOT_YET = ("awq", "gptq", "compressed-tensors")  # safetensors checkpoints quantized by these tools


def checkpoint_method(model: str) -> str | None:
    """The checkpoint's own quantization: "gguf" for a GGUF file, a folder's quant_method, or None."""
    if model.endswith(".gguf"):
        return "gguf"
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    method = (config.get("quantization_config") or {}).get("quant_method")
    return str(method) if method else None


def resolve_quantization(requested: str | None, model: str) -> str | None:
    """The method the worker loads with: "gguf" (blocks kept packed), None (float weights), or the
    checkpoint's own (gpt-oss's "mxfp4", dequantized by its family at load)."""
    own = checkpoint_method(model)
    if requested is not None and requested not in METHODS:
        raise UnsupportedModelError(f"--quantization {requested!r}: choose from {', '.join(METHODS)}")
    if requested == "none":
        if own is not None and own != "gguf":
            raise UnsupportedModelError(
                f"--quantization none: {model!r} holds {own} weights, which are not dequantized at load"
            )
        return None
    if requested is not None and requested != own:
        raise UnsupportedModelError(
            f"--quantization {requested}: the checkpoint {model!r} is "
            + (f"quantized with {own}" if own else "not quantized")
        )
    if own in NOT_YET:
        raise UnsupportedModelError(f"{model!r}: {own} checkpoints are not served yet (quantization_config)")
    return own


def packed_blocks(config: WorkerConfig) -> bool:
    """Whether this worker serves a GGUF file's quantized weights as the file's blocks: --quantization gguf,
    or the file's own, on the CPU with the csrc kernels and one rank. Asked for where it cannot be, a start
    error naming why; left to the default, such a worker dequantizes them, saying so."""
    method = resolve_quantization(config.quantization, config.model)
    if method != "gguf":
        return False
    import torch

    from worker.csrc_ops import load_cpu_ops

    reasons = []
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        reasons.append("the CUDA worker")
    elif config.attention_backend == "torch" or load_cpu_ops(build=True) is None:
        reasons.append("the torch paths (no csrc kernels)")
    if config.parallel.tensor_parallel_size > 1:
        reasons.append(f"--tensor-parallel-size {config.parallel.tensor_parallel_size}")
    if not reasons:
        return True
    why = f"GGUF blocks kept packed are served by the csrc kernels on one CPU worker, not {' or '.join(reasons)}"
    if config.quantization == "gguf":
        raise UnsupportedModelError(f"--quantization gguf: {why}; --quantization none dequantizes them")
    logger.info("%s: the GGUF weights are dequantized to the model's dtype", why)
    return False
