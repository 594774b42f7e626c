"""LLaVA (LlavaForConditionalGeneration): a language model of any decoder family, with a vision tower (CLIP
or SigLIP, worker/models/vit.py) whose features of one layer, projected onto the language model's width,
replace the image placeholder tokens' embeddings (worker/mm_inputs.py places them).

The language model is the shared decoder (its csrc stack and kernels, prefix cache, LoRA); the image side
loads name for name, and the tower layers past the feature layer, which change nothing, are not built."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from worker.model_config import ModelConfig, UnsupportedModelError, VisionConfig
from worker.models.causal_lm import CausalLM
from worker.models.checkpoint import load_checkpoint
from worker.models.vit import Projector, VisionTransformer

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.parallel.group import TensorParallelGroup

# checkpoint names (transformers' layouts, the released checkpoints' with `vision_model.`) -> ours, in order
IMAGE_NAMES = (
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


class LlavaModel(CausalLM):
    image_names: tuple[tuple[str, str], ...] = IMAGE_NAMES  # a subclass's checkpoint names of its image side

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, ops, tp)
        assert config.vision is not None
        self.vision_tower = VisionTransformer(config.vision, dtype, ops)
        self.multi_modal_projector = self.projector(config.vision, config.hidden_size, dtype)

    def projector(self, vision: VisionConfig, text_width: int, dtype: torch.dtype) -> torch.nn.Module:
        return Projector(vision, text_width, dtype)

    def check_image(self, tensors: dict[str, torch.Tensor]) -> None:
        """ValueError unless the processor's outputs are what the tower takes: one image's pixel_values."""
        vision = self.config.vision
        assert vision is not None
        shape = [1, vision.num_channels, vision.image_size, vision.image_size]
        pixels = tensors.get("pixel_values")
        if set(tensors) != {"pixel_values"} or pixels is None or list(pixels.shape) != shape:
            raise ValueError(f"the tower takes pixel_values of shape {shape}")
        if not pixels.is_floating_point():
            raise ValueError("pixel_values must be floating point")

    def encode_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs -> its embeddings [num_image_tokens, hidden]."""
        features = self.vision_tower(tensors["pixel_values"])
        embeds: torch.Tensor = self.multi_modal_projector(features)
        return embeds

    def load_weights(self, weights: Iterable[tuple[str, Any]], packed: bool = False) -> None:
        image_side: dict[str, torch.Tensor] = {}

        def text_side() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                for marker, ours in self.image_names:
                    at = name.find(marker)
                    if at >= 0:
                        image_side[ours + name[at + len(marker) :]] = tensor
                        break
                else:
                    yield name, tensor

        load_checkpoint(self, self.config, text_side(), packed)
        self._load_image_side(image_side)

    def _load_image_side(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self.config.vision is not None
        built = self.config.vision.num_layers
        params = {
            name: p
            for name, p in self.named_parameters()
            if name.startswith(("vision_tower.", "multi_modal_projector."))
        }
        # SigLIP's pooling head: the features are hidden states, never its pooled output
        unused = re.compile(r"vision_tower\.(post_layernorm\.|head\.|encoder\.layers\.(\d+)\.)")
        for name, tensor in tensors.items():
            param = params.pop(name, None)
            if param is None:
                match = unused.match(name)
                if match and (match.group(2) is None or int(match.group(2)) >= built):
                    continue  # past the feature layer, the norm of the last layer's output, the head
                raise UnsupportedModelError(f"unexpected tensor {name!r} in the checkpoint's image side")
            if tuple(tensor.shape) != tuple(param.shape):
                raise UnsupportedModelError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
        if params:
            raise UnsupportedModelError(f"the checkpoint lacks {', '.join(sorted(params)[:4])}")
