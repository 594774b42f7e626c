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


# LLaVA-1.5's chat template in spirit: each turn's images first (one <image> each), then its text
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_llava_folder(folder: str, tokenizer: Any, seed: int = 0) -> None:
    """A servable tiny LLaVA: the model, a tokenizer with an <image> token, CLIP's image processor at the
    tower's size and the chat template, saved as transformers' LlavaProcessor saves them."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    build_tiny_llava(folder, len(tokenizer), image_token_id, seed, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                               num_additional_image_tokens=1)  # fmt: skip
    processor.save_pretrained(folder)  # the tokenizer and the template too


def png_bytes(seed: int, size: tuple[int, int] = (80, 64), kind: str = "PNG") -> bytes:
    """A small picture with structure (gradients and noise), so that resizing and cropping show."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    base = (x * rng.uniform(0.2, 1.0, 3) + y * rng.uniform(0.2, 1.0, 3)) / 2
    array = np.clip(base + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=kind)
    return out.getvalue()


# Idefics3 / SmolVLM: tiles of 50 px on 2 px patches, 25 a side, a count at which transformers' bucketized
# positions are not the plain ones; pixel shuffle by 5 leaves 25 embeddings a tile; up to 2x2 tiles and the
# whole image
TILE, TILE_PATCH, SCALE = 50, 2, 5
TILE_TOKENS = (TILE // TILE_PATCH) ** 2 // SCALE**2
# SmolVLM's chat template: each part in order, an image as one <image>
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}{% if message['content'] is string "
    "%}{{ ': ' + message['content'] }}{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}"
    "{{ ': ' }}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build_idefics3_folder(folder: str, tokenizer: Any, architecture: str = "Idefics3", seed: int = 0) -> Any:
    """A servable tiny Idefics3 (or SmolVLM: the same model under SmolVLM's names): the model, a tokenizer with
    Idefics3's image tokens, its image processor (tiles of the tower's size) and SmolVLM's chat template, saved
    as transformers' Idefics3Processor saves them (SmolVLM's own processor needs torchvision)."""
    import transformers
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, LlamaConfig

    tokenizer.add_tokens(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                          *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))],
                         special_tokens=True)  # fmt: skip
    tokenizer.chat_template = SMOLVLM_TEMPLATE
    torch.manual_seed(seed)
    vision = getattr(transformers, f"{architecture}VisionConfig")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=TILE_PATCH,
    )  # fmt: skip
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    config = getattr(transformers, f"{architecture}Config")(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
    )  # fmt: skip
    model = getattr(transformers, f"{architecture}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif "position_embedding" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=TILE_TOKENS,
                                  chat_template=SMOLVLM_TEMPLATE)  # fmt: skip
    processor.save_pretrained(folder)
    return model


# Gemma 3: a SigLIP tower on 56 px images of 4 px patches (14 a side), pooled by 2 onto 49 soft tokens; a
# 4-layer Gemma 3 language model whose sliding layers' window (32) is shorter than an image's run, so that
# the window and the image's both-ways attention meet
G3_IMAGE, G3_PATCH, G3_TOKENS, G3_WINDOW = 56, 4, 49, 32
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_gemma3_folder(folder: str, tokenizer: Any, seed: int = 0) -> Any:
    """A servable tiny Gemma 3 with images: the model, a tokenizer with Gemma 3's image tokens (named as its
    tokenizer names them), Gemma3ImageProcessor's config and Gemma 3's chat template, saved as transformers'
    Gemma3Processor saves them."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer.add_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>",
                          "<end_of_turn>"], special_tokens=True)  # fmt: skip
    tokenizer._set_model_specific_special_tokens(  # what Gemma's tokenizer config names
        special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    )
    tokenizer.chat_template = GEMMA3_TEMPLATE
    torch.manual_seed(seed)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                image_size=G3_IMAGE, patch_size=G3_PATCH)  # fmt: skip
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            sliding_window=G3_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                            query_pre_attn_scalar=20, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=0)  # fmt: skip
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=G3_TOKENS,
                          boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
                          image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"))  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if name.endswith("weight") and "soft_emb" not in name else 0.0, 0.2)
            elif "position_embedding" in name or "mm_input_projection" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    images = Gemma3ImageProcessorPil(size={"height": G3_IMAGE, "width": G3_IMAGE})
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=G3_TOKENS,
                    chat_template=GEMMA3_TEMPLATE).save_pretrained(folder)  # fmt: skip
    return model
