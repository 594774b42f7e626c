"""Gemma 3 with images (Gemma3ForConditionalGeneration): LLaVA's shape (worker/models/llava.py) with a SigLIP
tower run to its last layer and post_layernorm, its features average-pooled onto mm_tokens_per_image and
projected (worker/models/vit.py's PoolProjector). (Pan and scan's crops come only when a processor call asks
for them, which ours never does.)

Its language model is Gemma 3's, in which an image's tokens see each other both ways: worker/mm_inputs.py
marks each run of them for the attention (worker/models/image_attention.py)."""

from __future__ import annotations

import torch

from worker.model_config import VisionConfig
from worker.models.llava import LlavaModel
from worker.models.vit import PoolProjector


class Gemma3VisionModel(LlavaModel):
    def projector(self, vision: VisionConfig, text_width: int, dtype: torch.dtype) -> torch.nn.Module:
        return PoolProjector(vision, text_width, dtype)

    def encode_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image -> its embeddings [tokens_per_image, hidden]."""
        embeds: torch.Tensor = self.multi_modal_projector(self.vision_tower(tensors["pixel_values"]))
        return embeds
