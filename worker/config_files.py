"""A model's ModelConfig: from a Hugging Face folder (config.json, generation_config.json; a decoder's by its
family, worker/models/families/; a BERT encoder's here) or from a GGUF file's metadata."""

from __future__ import annotations

import json
import os
from typing import Any

from worker.model_config import ModelConfig, UnsupportedModelError, eos_ids

ENCODER_ARCHITECTURES = {"BertModel": "bert", "BertForSequenceClassification": "bert"}
ENCODER_DECODER_ARCHITECTURES = ("WhisperForConditionalGeneration",)
# a language model with a vision tower (worker/models/vision_config.py)
VISION_LANGUAGE_ARCHITECTURES = (
    "LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
)


def supported_architectures() -> list[str]:
    from worker.models.families import BY_ARCHITECTURE

    # a set: an architecture may be in two (Gemma 3's multimodal checkpoints serve text alone too)
    return sorted({*BY_ARCHITECTURE, *ENCODER_ARCHITECTURES, *ENCODER_DECODER_ARCHITECTURES,
                   *VISION_LANGUAGE_ARCHITECTURES})  # fmt: skip


def load_model_config(model: str, gguf_reader: Any = None) -> ModelConfig:
    """gguf_reader: an open gguf.GGUFReader of `model`, to avoid parsing the file twice."""
    if model.endswith(".gguf"):
        return _from_gguf(model, gguf_reader)
    if os.path.isdir(model):
        return _from_hf_folder(model)
    raise UnsupportedModelError(f"{model!r} is neither a model folder nor a .gguf file")


def _from_hf_folder(folder: str) -> ModelConfig:
    from worker.models.families import BY_ARCHITECTURE, HFConfig

    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise UnsupportedModelError(f"{folder!r} has no config.json")
    with open(path) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    known = {**BY_ARCHITECTURE, **ENCODER_ARCHITECTURES,
             **dict.fromkeys(ENCODER_DECODER_ARCHITECTURES + VISION_LANGUAGE_ARCHITECTURES)}  # fmt: skip
    architecture = next((a for a in architectures if a in known), None)
    if architecture is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures}; supported: {', '.join(supported_architectures())}"
        )
    if architecture in ENCODER_ARCHITECTURES:
        return _bert(config, architecture)
    eos = eos_ids(config.get("eos_token_id"))
    generation_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path) as f:
            eos = eos_ids(json.load(f).get("eos_token_id")) or eos
    if architecture in ENCODER_DECODER_ARCHITECTURES:
        from worker.models.whisper_config import whisper_config

        return whisper_config(HFConfig(config, architecture), eos)
    if architecture in VISION_LANGUAGE_ARCHITECTURES:
        from worker.models.vision_config import vision_language_config

        return vision_language_config(folder, config, architecture, eos)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return BY_ARCHITECTURE[architecture].config(HFConfig(config, architecture), eos, dtype)


def _bert(config: dict[str, Any], architecture: str) -> ModelConfig:
    num_heads = config["num_attention_heads"]
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(
            f"BERT with {config['position_embedding_type']!r} position embeddings: only absolute ones run"
        )
    if config.get("hidden_act", "gelu") not in ("gelu", "relu", "gelu_new"):
        raise UnsupportedModelError(
            f"BERT with hidden_act {config['hidden_act']!r}: gelu, relu, gelu_new run"
        )
    classifies = architecture.endswith("ForSequenceClassification")
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()} if classifies else {}
    return ModelConfig(
        family="bert",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("layer_norm_eps", 1e-12),
        rope_theta=0.0,
        max_position_embeddings=config.get("max_position_embeddings", 512),
        tie_word_embeddings=False,
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        architecture=architecture,
        type_vocab_size=config.get("type_vocab_size", 2),
        hidden_act=config.get("hidden_act", "gelu"),
        num_labels=(config.get("num_labels") or len(id2label) or 2) if classifies else 0,
        id2label=id2label,
    )


def open_gguf(path: str) -> Any:
    import gguf

    if not os.path.exists(path):
        raise UnsupportedModelError(f"no such GGUF file: {path!r}")
    return gguf.GGUFReader(path)


def _from_gguf(path: str, reader: Any) -> ModelConfig:
    from worker.models.families.gguf import gguf_config

    return gguf_config(reader or open_gguf(path))
