"""The worker's dtype: the checkpoint's, or what --dtype names, as this CPU computes it best."""

from __future__ import annotations

import logging

import torch

from worker.model_config import ModelConfig

logger = logging.getLogger("engine.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """bf16 products in hardware: AVX-512 BF16 or AMX (torch's own CPU probes)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    if name == "auto":
        # NOTE: CPU matmuls in float16 are slow and lossy; auto picks bfloat16 for half-precision checkpoints,
        # where the CPU has bf16 arithmetic (AVX-512 BF16 or AMX). Without it (an AVX2-only EPYC) torch
        # emulates bf16 products: a 64 x 576 x 1536 product took 16.4 ms in bf16 against 2.7 ms in float32.
        checkpoint = model_config.torch_dtype.removeprefix("torch.")
        if checkpoint not in ("bfloat16", "float16"):
            return torch.float32
        if cpu_has_bf16():
            return torch.bfloat16
        logger.info(
            "this CPU has no bf16 arithmetic (AVX-512 BF16 or AMX): serving %s in float32", checkpoint
        )
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[name]
