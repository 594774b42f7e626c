"""Model registry: BERT encoders, and every decoder family on the shared decoder (worker/models/families/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.model_config import ModelConfig

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.models.bert import BertModel
    from worker.models.causal_lm import CausalLM
    from worker.models.whisper import WhisperModel
    from worker.parallel.group import TensorParallelGroup


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    ops: CpuOps | None = None,
    tp: TensorParallelGroup | None = None,
) -> CausalLM | BertModel | WhisperModel:
    """ops: the csrc kernels for the fused layers, or None for plain torch; tp: a tensor-parallel rank's
    share (config is then the rank's, worker/parallel/sharding.py). Call finalize() after loading."""
    if config.family == "bert":
        from worker.models.bert import BertModel

        return BertModel(config, dtype, ops)
    if config.family == "whisper":
        from worker.models.whisper import WhisperModel

        return WhisperModel(config, dtype, ops)
    from worker.models.causal_lm import CausalLM

    if config.vision is not None and config.vision.connector == "pool":
        from worker.models.gemma3_vision import Gemma3VisionModel

        return Gemma3VisionModel(config, dtype, ops, tp)
    if config.vision is not None and config.vision.connector == "pixel_shuffle":
        from worker.models.idefics3 import Idefics3Model

        return Idefics3Model(config, dtype, ops, tp)
    if config.vision is not None:
        from worker.models.llava import LlavaModel

        return LlavaModel(config, dtype, ops, tp)
    # NOTE: built on the CPU with uninitialized weights (the layers skip reset_parameters), not on the meta
    # device: the meta path's first op imported torch's Python decompositions, 1.9-3.9 s of a start
    return CausalLM(config, dtype, ops, tp)
