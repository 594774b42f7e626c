"""ModelConfig: the architecture facts the model code needs, from an HF folder or a GGUF file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedModelError(ValueError):
    """The model folder or file holds an architecture or format we do not run."""


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama", "qwen2", "qwen3" or "bert"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # the checkpoint's dtype, used for dtype="auto"
    architecture: str = ""  # the checkpoint's class, e.g. "BertModel" (GGUF: its general.architecture)
    # encoders (BERT): rms_norm_eps holds layer_norm_eps; token types and the activation of the MLP
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    num_labels: int = 0  # a *ForSequenceClassification head's outputs (0: none)
    id2label: dict[int, str] = field(default_factory=dict)

    @property
    def is_encoder(self) -> bool:
        """Bidirectional attention over the whole input (BERT): no KV cache, no chunked prefill."""
        return self.family == "bert"

    @staticmethod
    def load(model: str, gguf_reader: Any = None) -> ModelConfig:
        """gguf_reader: an open gguf.GGUFReader of `model`, to avoid parsing the file twice."""
        if model.endswith(".gguf"):
            return _from_gguf(model, gguf_reader)
        if os.path.isdir(model):
            return _from_hf_folder(model)
        raise UnsupportedModelError(f"{model!r} is neither a model folder nor a .gguf file")


def _from_hf_folder(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise UnsupportedModelError(f"{folder!r} has no config.json")
    with open(path) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = next(a for a in architectures if a in SUPPORTED_ARCHITECTURES)
    if family == "bert":
        return _bert(config, architecture)
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    rope_theta = config.get("rope_theta")
    rope_scaling = config.get("rope_scaling")
    rope_parameters = config.get("rope_parameters")  # transformers >= 5 folds theta and scaling here
    if rope_parameters:
        rope_theta = rope_parameters.get("rope_theta", rope_theta)
        if rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
    eos = _eos_ids(config.get("eos_token_id"))
    classifies = architecture.endswith("ForSequenceClassification")
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()} if classifies else {}
    generation_path = os.path.join(folder, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path) as f:
            eos = _eos_ids(json.load(f).get("eos_token_id")) or eos
    return ModelConfig(
        family=family,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta or 10000.0,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        # a classifier's checkpoint has a score head and no lm_head: the embedding stands in, never used
        tie_word_embeddings=config.get("tie_word_embeddings", False) or classifies,
        rope_scaling=rope_scaling,
        attention_bias=family == "qwen2" or config.get("attention_bias", False),
        qk_norm=family == "qwen3",
        eos_token_ids=eos,
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        architecture=architecture,
        num_labels=(config.get("num_labels") or len(id2label) or 2) if classifies else 0,
        id2label=id2label,
    )


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


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def open_gguf(path: str) -> Any:
    import gguf

    if not os.path.exists(path):
        raise UnsupportedModelError(f"no such GGUF file: {path!r}")
    return gguf.GGUFReader(path)


def _from_gguf(path: str, reader: Any) -> ModelConfig:
    reader = reader or open_gguf(path)

    def get(key: str, default: Any = None) -> Any:
        field_ = reader.fields.get(key)
        return default if field_ is None else field_.contents()

    arch = get("general.architecture")
    family = GGUF_ARCHITECTURES.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    hidden_size = get(f"{arch}.embedding_length")
    num_heads = get(f"{arch}.attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens", []))
    eos = get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=get(f"{arch}.attention.key_length") or hidden_size // num_heads,
        rms_norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        eos_token_ids=[] if eos is None else [int(eos)],
        # NOTE: GGUF weights are dequantized; "auto" serves them in bfloat16 like the models they came from.
        torch_dtype="bfloat16",
    )
