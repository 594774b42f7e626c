"""A vision-language checkpoint's config.json as our ModelConfig: its language model as the family of its
text_config says, its image side as a VisionConfig. A field we do not implement is refused by name.

Released checkpoints write only the sub-config fields that differ from transformers' defaults (LLaVA-1.5's
vision_config names 9 fields), so each sub-config is read over its transformers class's defaults."""  # noqa: E501

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from worker.model_config import ModelConfig, UnsupportedModelError, VisionConfig, eos_ids
from worker.models.families.base import ACTIVATIONS, HFConfig

# a text_config's model_type -> the decoder family's architecture
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
VISION_TOWERS = ("clip_vision_model", "siglip_vision_model")


# transformers' defaults of the sub-configs a checkpoint may leave out (tests/test_vision_config.py holds them
# equal to transformers' own): the worker reads config.json without importing transformers
SUB_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "use_sliding_window": False},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "hidden_activation": "gelu_pytorch_tanh"},
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    "idefics3_vision": {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                        "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                        "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    "smolvlm_vision": {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                       "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}  # fmt: skip
# each vision-language architecture: the text model its config defaults to, and what its default text model
# changes (Idefics3's, with no text_config at all, has rms_norm_eps 1e-5)
TEXT_DEFAULTS = {
    "LlavaForConditionalGeneration": ("llama", {}),
    "Idefics3ForConditionalGeneration": ("llama", {"rms_norm_eps": 1e-5}),
    "SmolVLMForConditionalGeneration": ("llama", {"rms_norm_eps": 1e-5}),
    "Gemma3ForConditionalGeneration": ("gemma3_text", {}),
}
# the architectures whose text model ties its embeddings unless a config says otherwise
TIED_BY_DEFAULT = ("Gemma3ForConditionalGeneration",)


def with_defaults(
    values: dict[str, Any], default_type: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    model_type = values.get("model_type") or default_type
    defaults = SUB_CONFIG_DEFAULTS.get(model_type)
    if defaults is None:
        raise UnsupportedModelError(
            f"a {model_type!r} sub-model is not supported; supported: {', '.join(SUB_CONFIG_DEFAULTS)}"
        )
    defaults = {**defaults, **(overrides or {})} if model_type == default_type else defaults
    return {**defaults, "model_type": model_type, **{k: v for k, v in values.items() if v is not None}}


def vision_language_config(
    folder: str, config: dict[str, Any], architecture: str, eos_token_ids: list[int]
) -> ModelConfig:
    """The language model as its text_config's family says, and the image side as the family's."""
    from worker.models.families import BY_ARCHITECTURE

    hf = HFConfig(config, architecture)
    default_type, overrides = TEXT_DEFAULTS[architecture]
    given = config.get("text_config")  # transformers' overrides apply to a config without one only
    text = with_defaults(given or {}, default_type, overrides if given is None else None)
    text_architecture = TEXT_ARCHITECTURES.get(text["model_type"])
    if text_architecture is None:
        raise hf.fail(f"a {text['model_type']!r} language model is not supported; "
                      f"supported: {', '.join(TEXT_ARCHITECTURES)}")  # fmt: skip
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", architecture in TIED_BY_DEFAULT))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "float32")
    eos = eos_token_ids or eos_ids(text.get("eos_token_id"))
    # a family that serves the vision-language class itself reads its text model as that class's (Gemma 3's
    # never soft-caps its logits)
    as_class = architecture if architecture in BY_ARCHITECTURE else text_architecture
    language = BY_ARCHITECTURE[text_architecture].config(HFConfig(text, as_class), eos, dtype)
    builds = {"LlavaForConditionalGeneration": clip_like, "Gemma3ForConditionalGeneration": gemma3_like}
    vision = builds.get(architecture, idefics3_like)(hf, folder)
    return dataclasses.replace(language, architecture=hf.architecture, vision=vision)


def clip_like(hf: HFConfig, folder: str) -> VisionConfig:
    """LLaVA's tower (CLIP or SigLIP), the features of one layer, the two-product projector."""
    vision = HFConfig(with_defaults(hf.get("vision_config", {}), "clip_vision_model"), hf.architecture)
    kind = vision.get("model_type")
    if kind not in VISION_TOWERS:
        raise hf.fail(f"vision tower {kind!r} is not supported; supported: {', '.join(VISION_TOWERS)}")
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise hf.fail(f"vision_feature_layer={layer!r}: features of several layers are not supported")
    layers = vision.get("num_hidden_layers")
    run = layer if layer >= 0 else layers + 1 + layer  # hidden_states[0] is the embeddings
    if not 0 <= run <= layers:
        raise hf.fail(f"vision_feature_layer={layer} is outside the tower's {layers} layers")
    hf.refuse("vision_feature_select_strategy", ("default", "full"))
    image_token = hf.get("image_token_id", hf.get("image_token_index"))
    if image_token is None:
        raise hf.fail("config.json names no image_token_index")
    return VisionConfig(
        hidden_size=vision.get("hidden_size"),
        intermediate_size=vision.get("intermediate_size"),
        num_layers=run,
        num_heads=vision.get("num_attention_heads"),
        image_size=vision.get("image_size"),
        patch_size=vision.get("patch_size"),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
        hidden_act=activation(vision, vision.get("hidden_act")),
        class_token=kind == "clip_vision_model",
        patch_bias=kind == "siglip_vision_model",
        pre_norm=kind == "clip_vision_model",
        post_norm=False,  # hidden_states[layer] are the layers' outputs, before the tower's post_layernorm
        drop_first=hf.get("vision_feature_select_strategy", "default") == "default",
        projector_act=activation(hf, hf.get("projector_hidden_act", "gelu")),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        image_token_id=int(image_token),
        num_channels=vision.get("num_channels", 3),
    )


def idefics3_like(hf: HFConfig, folder: str) -> VisionConfig:
    """Idefics3's and SmolVLM's: a SigLIP tower (every layer, then its post_layernorm) on each tile of an
    image, pixel shuffle, one product; the tiles an image can make are its image processor's to say."""
    family = "smolvlm" if hf.architecture.startswith("SmolVLM") else "idefics3"
    values = dict(hf.get("vision_config") or {})
    if values.get("model_type") in (family, None):  # the released checkpoints name the family's own type
        values["model_type"] = f"{family}_vision"
    if values["model_type"] != f"{family}_vision":
        raise hf.fail(f"vision tower {values['model_type']!r} is not supported; supported: {family}_vision")
    vision = HFConfig(with_defaults(values, f"{family}_vision"), hf.architecture)
    scale = hf.get("scale_factor", 2)
    image_size, patch = vision.get("image_size"), vision.get("patch_size")
    if not isinstance(image_size, int) or not isinstance(patch, int):
        raise hf.fail("vision_config: image_size and patch_size must be integers (square patches)")
    if (image_size // patch) % scale:
        raise hf.fail(
            f"scale_factor={scale} does not divide the tower's {image_size // patch} patches a side"
        )
    image_token = hf.get("image_token_id")
    if image_token is None:
        raise hf.fail("config.json names no image_token_id")
    return VisionConfig(
        **siglip_tower(vision),
        image_token_id=int(image_token),
        connector="pixel_shuffle",
        scale_factor=scale,
        max_tiles=max_tiles(folder, hf, image_size),
    )


def siglip_tower(vision: HFConfig) -> dict[str, Any]:
    """A SigLIP tower run through every layer and its post_layernorm, no class token, every patch kept;
    the connector after it is a norm and one product or one product alone (projector_act and _bias unused)."""
    return dict(
        hidden_size=vision.get("hidden_size"),
        intermediate_size=vision.get("intermediate_size"),
        num_layers=vision.get("num_hidden_layers"),
        num_heads=vision.get("num_attention_heads"),
        image_size=vision.get("image_size"),
        patch_size=vision.get("patch_size"),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        hidden_act=activation(vision, vision.get("hidden_act")),
        class_token=False,
        patch_bias=True,
        pre_norm=False,
        post_norm=True,
        drop_first=False,
        projector_act="gelu",
        projector_bias=False,
        num_channels=vision.get("num_channels", 3),
    )


def max_tiles(folder: str, hf: HFConfig, image_size: int) -> int:
    """The most tiles the image processor cuts one image into: its tiles a side squared, and the whole image
    once more (transformers' Idefics3ImageProcessor); from preprocessor_config.json or processor_config.json."""
    settings = image_processor_settings(folder)
    if settings is None:
        raise hf.fail(f"{folder} has no image processor config (preprocessor_config.json)")
    if not settings.get("do_image_splitting", True):
        return 1
    longest = (settings.get("size") or {}).get("longest_edge")
    tile = (settings.get("max_image_size") or {}).get("longest_edge")
    if not isinstance(longest, int) or not isinstance(tile, int) or tile <= 0:
        raise hf.fail("the image processor's size and max_image_size must each name a longest_edge")
    if tile != image_size:
        raise hf.fail(f"the image processor's tiles (max_image_size {tile}) are not the tower's image_size "
                      f"{image_size}")  # fmt: skip
    return math.ceil(longest / tile) ** 2 + 1


def image_processor_settings(folder: str) -> dict[str, Any] | None:
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                settings = json.load(f)
            settings = settings.get(key) if key else settings
            if isinstance(settings, dict):
                return settings
    return None


def gemma3_like(hf: HFConfig, folder: str) -> VisionConfig:
    """Gemma 3's: a SigLIP tower to its last layer and post_layernorm, its features average-pooled onto
    mm_tokens_per_image, normed and projected."""
    vision = HFConfig(with_defaults(hf.get("vision_config", {}), "siglip_vision_model"), hf.architecture)
    if vision.get("model_type") != "siglip_vision_model":
        raise hf.fail(
            f"vision tower {vision.get('model_type')!r} is not supported; supported: siglip_vision_model"
        )
    tokens, side = hf.get("mm_tokens_per_image", 256), vision.get("image_size") // vision.get("patch_size")
    if math.isqrt(tokens) ** 2 != tokens or side % math.isqrt(tokens):
        raise hf.fail(
            f"mm_tokens_per_image={tokens} does not pool the tower's {side} x {side} patches evenly"
        )
    return VisionConfig(
        **siglip_tower(vision),
        image_token_id=int(hf.get("image_token_index", 262144)),
        connector="pool",
        max_tiles=1,  # pan and scan's crops only come when a call asks (vLLM's --mm-processor-kwargs)
        tokens_per_image=tokens,
        bidirectional=True,
    )


def activation(hf: HFConfig, name: str) -> str:
    if name == "quick_gelu":
        return name
    if name not in ACTIVATIONS:
        raise hf.fail(f"activation {name!r} is not supported")
    return ACTIVATIONS[name]
