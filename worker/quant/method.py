"""`--quantization`, as vLLM spells it: what the checkpoint says (a GGUF file's tensor types, a folder's
`quantization_config`) unless the flag says otherwise; a flag that contradicts the checkpoint is a start
error, and `none` dequantizes a GGUF file's or an AWQ, GPTQ or weight-only compressed-tensors checkpoint's
weights to the model's dtype at load."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from worker.model_config import UnsupportedModelError

if TYPE_CHECKING:
    from protocol.config import WorkerConfig

logger = logging.getLogger("engine.worker")

METHODS = ("gguf", "awq", "gptq", "compressed-tensors", "mxfp4", "none")
INTEGER = (
    "awq",
    "gptq",
    "compressed-tensors",
)  # safetensors checkpoints of integers (worker/quant/formats.py)
PACKED = ("gguf", *INTEGER, "mxfp4")  # served packed by csrc/quant_cpu.cpp (mxfp4: gpt-oss's experts)


def quantization_config(model: str) -> dict[str, Any] | None:
    """A checkpoint folder's quantization_config (None for a GGUF file or a float checkpoint)."""
    path = os.path.join(model, "config.json")
    if model.endswith(".gguf") or not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("quantization_config") or None


def checkpoint_method(model: str) -> str | None:
    """The checkpoint's own quantization: "gguf" for a GGUF file, a folder's quant_method, or None."""
    if model.endswith(".gguf"):
        return "gguf"
    method = (quantization_config(model) or {}).get("quant_method")
    return str(method) if method else None


def activations_quantized(model: str) -> bool:
    """Whether a compressed-tensors checkpoint quantizes its products' activations (W8A8)."""
    from worker.quant.formats import read_format

    return any(scheme.activations for _, scheme in read_format(quantization_config(model) or {}).schemes)


def resolve_quantization(requested: str | None, model: str) -> str | None:
    """The method the worker loads with: one of PACKED (served packed where the worker can), None (float
    weights; a quantized checkpoint's dequantized at load), or the checkpoint's own (gpt-oss's "mxfp4",
    dequantized by its family at load)."""
    own = checkpoint_method(model)
    if requested is not None and requested not in METHODS:
        raise UnsupportedModelError(f"--quantization {requested!r}: choose from {', '.join(METHODS)}")
    if requested == "none":
        if own in INTEGER and activations_quantized(model):
            raise UnsupportedModelError(
                f"--quantization none: {model!r} quantizes its activations too (W8A8); it is served as it is"
            )
        if own is not None and own not in PACKED:
            raise UnsupportedModelError(
                f"--quantization none: {model!r} holds {own} weights, which are not dequantized at load"
            )
        return None
    if requested is not None and requested != own:
        raise UnsupportedModelError(
            f"--quantization {requested}: the checkpoint {model!r} is "
            + (f"quantized with {own}" if own else "not quantized")
        )
    if own in INTEGER:
        from worker.quant.formats import read_format

        read_format(quantization_config(model) or {})  # a field not served: the start error names it
    return own


def packed_blocks(config: WorkerConfig) -> bool:
    """Whether this worker serves the checkpoint's quantized weights packed (a GGUF file's blocks, an AWQ,
    GPTQ or compressed-tensors checkpoint's integers): its own quantization or the flag's, on the CPU with
    the csrc kernels (each tensor-parallel rank its slice: worker/parallel/sharding.py). Asked for where it cannot be, a start error naming why; left to the
    default, such a worker dequantizes them, saying so (a checkpoint that quantizes its activations too
    is refused there)."""
    method = resolve_quantization(config.quantization, config.model)
    if method not in PACKED:
        return False
    import torch

    from worker.csrc_ops import load_cpu_ops

    reasons = []
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        reasons.append("the CUDA worker")
    elif config.attention_backend == "torch" or load_cpu_ops(build=True) is None:
        reasons.append("the torch paths (no csrc kernels)")
    if not reasons:
        return True
    why = (
        f"{method} weights kept packed are served by the csrc kernels on the CPU, not {' or '.join(reasons)}"
    )
    if config.quantization == method:
        raise UnsupportedModelError(f"--quantization {method}: {why}; --quantization none dequantizes them")
    if method in INTEGER and activations_quantized(config.model):
        raise UnsupportedModelError(f"{why}; {config.model!r} quantizes its activations too (W8A8)")
    logger.info("%s: the %s weights are dequantized to the model's dtype", why, method)
    return False


def int8_activations(config: WorkerConfig, packed: bool) -> bool:
    """--activation-quantization int8: whether the packed products take each row quantized to int8 per 32
    dims (csrc/quant_a8.cpp). Asked for where the weights are not kept packed, or where the checkpoint
    quantizes its activations in its own way (W8A8), a start error naming why."""
    if config.activation_quantization is None:
        return False
    if config.activation_quantization != "int8":
        raise UnsupportedModelError(
            f"--activation-quantization {config.activation_quantization!r}: the choice is int8"
        )
    if not packed:
        raise UnsupportedModelError(
            "--activation-quantization int8 quantizes the rows that multiply quantized weights kept packed, "
            f"and {config.model!r} is served with its weights in {config.dtype} here (a float checkpoint, "
            "--quantization none, or no csrc kernels)"
        )
    if resolve_quantization(config.quantization, config.model) in INTEGER and activations_quantized(
        config.model
    ):
        raise UnsupportedModelError(
            f"--activation-quantization int8: {config.model!r} quantizes its activations itself (W8A8)"
        )
    from worker import csrc_ops

    if csrc_ops.a8_vector_form() is None:
        # (the portable loop took 30-170x the default products' time on a Zen 4: 1 and 16 rows, Q5_0, Q4_K)
        logger.warning(
            "--activation-quantization int8: this CPU has no AVX2 (nor AVX-512 VNNI), so the int8 products run "
            "their portable loop, many times slower than the default products; serve without the flag"
        )
    return True
