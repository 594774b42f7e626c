"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): LLaVA's shape
(worker/models/llava.py) with an image cut into tiles by its processor (each tile of the tower's size, and
the whole image once more), a SigLIP tower run to its last layer and post_layernorm on each tile, and a
pixel-shuffle connector (worker/models/vit.py) instead of LLaVA's projector."""

from __future__ import annotations

import torch

from worker.model_config import VisionConfig
from worker.models.llava import LlavaModel
from worker.models.vit import PixelShuffleProjector

# checkpoint names (transformers' and the released checkpoints') -> ours; the text model's `model.text_model.`
# prefix is worker/models/checkpoint.py's
IDEFICS3_NAMES = (
    ("model.vision_model.", "vision_tower."),
    ("model.connector.modality_projection.", "multi_modal_projector."),
)


class Idefics3Model(LlavaModel):
    image_names = IDEFICS3_NAMES

    def projector(self, vision: VisionConfig, text_width: int, dtype: torch.dtype) -> torch.nn.Module:
        return PixelShuffleProjector(vision, text_width, dtype)

    def check_image(self, tensors: dict[str, torch.Tensor]) -> None:
        """ValueError unless the processor's outputs are one image's tiles, each of the tower's size and all
        of it real: pixel_values [1, tiles, channels, image_size, image_size]."""
        vision = self.config.vision
        assert vision is not None
        pixels, mask = tensors.get("pixel_values"), tensors.get("pixel_attention_mask")
        if pixels is None or set(tensors) - {"pixel_values", "pixel_attention_mask"}:
            raise ValueError("the tower takes pixel_values and pixel_attention_mask")
        shape, side = list(pixels.shape), vision.image_size
        if len(shape) != 5 or shape[0] != 1 or shape[2:] != [vision.num_channels, side, side]:
            raise ValueError(
                f"pixel_values of shape {shape}: expected [1, tiles, {vision.num_channels}, {side}, {side}]"
            )
        if not 1 <= shape[1] <= vision.max_tiles or not pixels.is_floating_point():
            raise ValueError(f"an image of {shape[1]} tiles (at most {vision.max_tiles}), floating point")
        if mask is not None and (list(mask.shape) != [1, *shape[1:2], *shape[3:]] or not bool(mask.all())):
            raise ValueError(
                "padded tiles are not supported: the pixel_attention_mask must cover every pixel"
            )

    def encode_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's tiles -> its embeddings [tiles * tokens a tile, hidden], tile after tile."""
        tiles = tensors["pixel_values"][0]
        return torch.cat([self.multi_modal_projector(self.vision_tower(tile[None])) for tile in tiles])
