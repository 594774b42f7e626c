"""Tiny random vision-language checkpoints built with transformers (the oracle), with biases and norms drawn
away from their neutral values so that a missing one shows; and images' processor outputs as the engine
takes them."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from protocol.media import MultiModalInput, TensorData

IMAGE_SIZE, PATCH = 56, 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # strategy "default": CLIP's class position dropped


def build_tiny_llava(folder: str, vocab_size: int, image_token_id: int, seed: int = 0, **text: Any) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)  # fmt: skip
    language = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              tie_word_embeddings=False), **text})  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=language, image_token_id=image_token_id,
                         image_seq_length=NUM_IMAGE_TOKENS)  # fmt: skip
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif "class_embedding" in name or "position_embedding" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def image_input(array: np.ndarray, prompt: list[int], offset: int, image_token_id: int) -> MultiModalInput:
    data = array.tobytes()
    length = NUM_IMAGE_TOKENS
    assert prompt[offset : offset + length] == [image_token_id] * length
    tensors = {"pixel_values": TensorData(data, list(array.shape), "float32")}
    return MultiModalInput("image", tensors, hashlib.sha256(data).hexdigest(), offset, length, length)
