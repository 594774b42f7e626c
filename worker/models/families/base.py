"""A model family: an architecture declared as its differences over the shared decoder.

A family says which Hugging Face classes and llama.cpp architectures it serves, which ModelConfig fields
its checkpoint's config sets (`options`, beyond the fields every decoder reads in `decoder_config`), how
its checkpoint names map onto ours (`renames`, regexes applied in order), and what it refuses: a config
field that would change the model's output and that we do not implement is an UnsupportedModelError
naming it, never a model that runs and answers differently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from worker.model_config import ModelConfig, UnsupportedModelError

# Rope types the rotary tables implement (worker/models/rope.py); HF's "su" and Phi-3's "yarn" spell longrope
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_fast",
    "gelu": "gelu",
    "relu": "relu",
}


class HFConfig:
    """A checkpoint's config.json (a VLM's text_config for its language model), read by a family."""

    def __init__(self, values: dict[str, Any], architecture: str) -> None:
        self.values, self.architecture = values, architecture

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def refuse(self, key: str, allowed: tuple[Any, ...], what: str = "") -> None:
        """A field whose other values we do not implement: absent, null or one of `allowed`."""
        value = self.values.get(key)
        if value is not None and value not in allowed:
            raise UnsupportedModelError(
                f"{self.architecture}: config field {key}={value!r} is not supported"
                + (f" ({what})" if what else f"; supported: {', '.join(map(repr, allowed))}")
            )

    def fail(self, message: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.architecture}: {message}")


Options = Callable[[HFConfig, dict[str, Any]], dict[str, Any]]


def no_options(hf: HFConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    # ModelConfig fields from the HF config, given the common ones decoder_config read
    options: Options = no_options
    default_rope_theta: float = 10000.0
    # (regex, replacement) on checkpoint names after their model prefix is dropped, in order
    renames: tuple[tuple[str, str], ...] = ()
    # GGUF: per-architecture tensor names beyond the shared table (worker/models/families/gguf.py)
    gguf_names: dict[str, str] = field(default_factory=dict)
    # a checkpoint tensor (by our name) as our layout holds it, when the two differ (GPT-NeoX's fused qkv)
    convert: Callable[[str, Any, ModelConfig], Any] | None = None
    # the checkpoint's (name, tensor) stream before any of that, where tensors combine (gpt-oss's MXFP4
    # blocks and scales into one weight); its bool: the worker keeps quantized weights packed
    combine: Callable[[Iterable[tuple[str, Any]], ModelConfig, bool], Iterator[tuple[str, Any]]] | None = None

    def config(self, hf: HFConfig, eos: list[int], torch_dtype: str) -> ModelConfig:
        common = decoder_config(hf, self.default_rope_theta)
        common.update(self.options(hf, common))
        return ModelConfig(family=self.name, eos_token_ids=eos, torch_dtype=torch_dtype, **common)

    def checkpoint_name(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name


def decoder_config(hf: HFConfig, default_theta: float) -> dict[str, Any]:
    """The fields every decoder's config.json spells alike (HF's Llama names)."""
    num_heads = hf.get("num_attention_heads")
    hidden = hf.get("hidden_size")
    head_dim = hf.get("head_dim") or hidden // num_heads
    theta, scaling, partial = rope_parameters(hf, default_theta)
    classifies = hf.architecture.endswith("ForSequenceClassification")
    id2label = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()} if classifies else {}
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    if act not in ACTIVATIONS:
        raise hf.fail(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    hf.refuse("pretraining_tp", (1,), "Llama's tensor-parallel pretraining emulation")
    return dict(
        vocab_size=hf.get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size"),
        num_layers=hf.get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=_rotary_dim(head_dim, partial),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        # a classifier's checkpoint has a score head and no lm_head: the embedding stands in, never used
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) or classifies,
        hidden_act=ACTIVATIONS[act],
        architecture=hf.architecture,
        num_labels=(hf.get("num_labels") or len(id2label) or 2) if classifies else 0,
        id2label=id2label,
    )


def _rotary_dim(head_dim: int, partial: float) -> int:
    rotary = int(head_dim * partial)
    return 0 if rotary == head_dim else rotary  # 0: the whole head


def rope_parameters(
    hf: HFConfig, default_theta: float, layer_type: str = "full_attention"
) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None, partial rotary factor) of a layer type, from transformers 5's
    `rope_parameters` (flat, or nested by layer type) or the legacy rope_theta / rope_scaling /
    partial_rotary_factor fields."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if params is None:  # legacy fields
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta", default_theta))
    partial = float(params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        raise hf.fail(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None, partial
    params["rope_type"] = kind
    if kind in ("yarn", "llama3", "longrope"):  # transformers' standardize_rope_params
        top = hf.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (
            top if top and kind == "longrope" else params.get("original_max_position_embeddings") or top
        ) or hf.get("max_position_embeddings")
    if kind in ("yarn", "dynamic", "longrope"):
        params.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    if kind == "yarn":
        top_level = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        params["truncate"] = bool(top_level.get("truncate", True))  # read from the top level in transformers
    return theta, params, partial


def layer_types(hf: HFConfig, default: Callable[[int], str] | None = None) -> list[str]:
    """Per-layer attention kinds ("full_attention" or "sliding_attention"): the config's layer_types,
    else the family's default pattern; [] when every layer is full."""
    num_layers = hf.get("num_hidden_layers")
    kinds = hf.get("layer_types")
    if kinds is None and default is not None:
        kinds = [default(i) for i in range(num_layers)]
    if not kinds:
        return []
    kinds = list(kinds)
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown or len(kinds) != num_layers:
        raise hf.fail(
            f"layer_types {sorted(unknown) or kinds!r}: full_attention and sliding_attention, one per layer"
        )
    return [] if all(kind == "full_attention" for kind in kinds) else kinds


def embedding_scale(hidden_size: int) -> float:
    """Gemma's normalizer: sqrt(hidden) as a float32 (torch.tensor(hidden ** 0.5))."""
    import struct

    return float(struct.unpack("f", struct.pack("f", math.sqrt(hidden_size)))[0])
