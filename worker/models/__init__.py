"""Model registry: a ModelConfig family -> its implementation, imported lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.model_config import ModelConfig

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.models.bert import BertModel
    from worker.models.llama import LlamaForCausalLM
    from worker.parallel.group import TensorParallelGroup


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    ops: CpuOps | None = None,
    tp: TensorParallelGroup | None = None,
) -> LlamaForCausalLM | BertModel:
    """ops: the csrc kernels for the fused layers, or None for plain torch; tp: a tensor-parallel rank's
    share (config is then the rank's, worker/parallel/sharding.py). Call finalize() after loading."""
    if config.family in ("llama", "qwen2", "qwen3"):
        from worker.models.llama import LlamaForCausalLM

        # NOTE: built on the CPU with uninitialized weights (the layers skip reset_parameters), not on the meta
        # device: the meta path's first op imported torch's Python decompositions, 1.9-3.9 s of a start
        return LlamaForCausalLM(config, dtype, ops, tp)
    if config.family == "bert":
        from worker.models.bert import BertModel

        return BertModel(config, dtype, ops)
    raise ValueError(f"no model implementation for family {config.family!r}")
