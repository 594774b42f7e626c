"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a dense decoder.

Module names go through the family's checkpoint names (StarCoder2's c_fc is our up_proj, GPT-NeoX's
query_key_value our qkv_proj). An adapter on a fused checkpoint product (Phi-3's qkv_proj and gate_up_proj,
GPT-NeoX's query_key_value) is one A shared by the parts and a B split by their rows: it is kept as each
part's (A, B rows), which adds the same products. A plain MLP (no gate) has up and down only.

Every check runs before anything is kept, so a folder that fails leaves the worker as it was; each
failure is an InvalidParameterError naming the problem (the HTTP edge answers 400 with it).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from protocol.errors import InvalidParameterError
from worker.model_config import ModelConfig
from worker.models.families import BY_NAME, our_name

# The projections an adapter may target, by the fused product of ours each one is a part of.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# a checkpoint's fused module -> our parts, in its rows' order
SPLIT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_TENSOR = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight")
_MODULE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight")


def products(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The fused products of `config`'s layers and their parts (a plain MLP: up alone)."""
    return FUSED if config.mlp == "gated" else {**FUSED, "gate_up": ("up_proj",)}


def targets_of(config: ModelConfig) -> tuple[str, ...]:
    """The modules an adapter may name, by our names (a fused checkpoint's where its parts are served). A
    mixture-of-experts model takes adapters on its attention only (its experts and router have no slots)."""
    served = {"qkv", "o"} if config.num_experts else set(FUSED)
    parts = tuple(name for fused, names in products(config).items() if fused in served for name in names)
    return parts + tuple(fused for fused, names in SPLIT.items() if set(names) <= set(parts))


def our_module(config: ModelConfig, path: str) -> tuple[int, str] | None:
    """(layer, our module name) of an adapter's module path, through the family's names; None: not a layer's."""
    match = _MODULE.fullmatch(our_name(config.family, f"{path}.weight"))
    return (int(match[1]), match[2]) if match else None


@dataclass
class LoraWeights:
    """One adapter's low-rank factors, scaled: module (layer, target) -> (A [rank, in], B [out, rank] x scale)."""

    rank: int
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in_features, out_features) of that projection in the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _refuse(message: str) -> InvalidParameterError:
    return InvalidParameterError("lora_path", message)


def read_adapter_config(path: str, max_rank: int, model: ModelConfig) -> tuple[int, float, set[str]]:
    """(rank, scale, targets by our names) from the folder's adapter_config.json, or an InvalidParameterError."""
    if not os.path.isdir(path):
        raise _refuse(f"no LoRA adapter folder at {path}")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise _refuse(f"{path} has no adapter_config.json (a PEFT LoRA folder has one)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise _refuse(f"{config_path} is not valid JSON: {error}") from error
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(f"{path} is a {config.get('peft_type')} adapter; only LoRA is served")
    for name, ok in (
        ("modules_to_save", not config.get("modules_to_save")),
        ("use_dora", not config.get("use_dora")),
        ("fan_in_fan_out", not config.get("fan_in_fan_out")),
        ("rank_pattern", not config.get("rank_pattern")),
        ("alpha_pattern", not config.get("alpha_pattern")),
        ("bias", config.get("bias", "none") in ("none", None)),
    ):
        if not ok:
            raise _refuse(f"adapter_config.json sets {name}={config.get(name)!r}, which is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise _refuse(f"adapter_config.json needs a positive integer r, not {rank!r}")
    if rank > max_rank:
        raise _refuse(f"the adapter's rank {rank} is over --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    allowed = targets_of(model)
    if targets == "all-linear":
        return rank, float(scale), set(allowed)
    if not isinstance(targets, list) or not targets:
        raise _refuse(
            f"target_modules {targets!r}: name the modules as a list (or 'all-linear'); "
            "a regular expression is not supported"
        )
    # peft matches a name or a dotted path's end ("model.layers.0.self_attn.q_proj" is a q_proj)
    wanted, unknown = set(), []
    for target in targets:
        leaf = str(target).rsplit(".", 1)[-1]
        ours = {
            our_module(model, f"model.layers.0.{part}.{leaf}") for part in ("self_attn", "mlp", "attention")
        }
        found = sorted(module[1] for module in ours if module is not None and module[1] in allowed)
        if found:
            wanted.add(found[0])
        else:
            unknown.append(leaf)
    if unknown:
        moe = " (a mixture-of-experts model: its attention)" if model.num_experts else ""
        raise _refuse(f"target modules {sorted(unknown)} are not supported; LoRA serves {list(allowed)}{moe}")
    return rank, float(scale), wanted


def load_adapter(path: str, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraWeights:
    """The adapter's factors in `dtype`, B scaled by lora_alpha / r (or / sqrt(r) with rsLoRA)."""
    rank, scale, targets = read_adapter_config(path, max_rank, config)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise _refuse(f"{path} has no adapter_model.safetensors (only the safetensors format is read)")
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _TENSOR.fullmatch(name)
            module = our_module(config, match[1]) if match else None
            if match is None or module is None:
                raise _refuse(
                    f"unexpected tensor {name!r} in the adapter (LoRA A/B of the decoder layers only)"
                )
            (layer, target), half = module, match[2]
            if target not in targets:
                raise _refuse(f"tensor {name!r} targets {target}, which target_modules does not list")
            if layer >= config.num_layers:
                raise _refuse(f"tensor {name!r} is for layer {layer}; the base model has {config.num_layers}")
            halves.setdefault((layer, target), {})[half] = f.get_tensor(name)
    factors = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(f"layer {layer} {target} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        parts = SPLIT.get(target, (target,))
        in_features = shapes[parts[0]][0]
        out_features = sum(shapes[part][1] for part in parts)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise _refuse(
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model ({out_features} x {in_features}) at rank {rank}"
            )
        b = _checkpoint_rows(config, layer, target, b)
        for part, rows in zip(parts, torch.split(b, [shapes[part][1] for part in parts]), strict=True):
            factors[(layer, part)] = (a.to(dtype), (rows.float() * scale).to(dtype))
    if not factors:
        raise _refuse(f"{weights_path} holds no LoRA weights")
    return LoraWeights(rank, factors)


def _checkpoint_rows(config: ModelConfig, layer: int, target: str, b: torch.Tensor) -> torch.Tensor:
    """B's rows in our order: the family's reordering of the product's weight (GPT-NeoX's heads)."""
    family = BY_NAME.get(config.family)
    if family is None or family.convert is None:
        return b
    section = "self_attn" if target in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    rows: torch.Tensor = family.convert(f"layers.{layer}.{section}.{target}.weight", b, config)
    return rows
