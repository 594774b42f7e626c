"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a dense decoder.

Module names go through the family's checkpoint names (StarCoder2's c_fc is our up_proj, GPT-NeoX's
query_key_value our qkv_proj). An adapter on a fused checkpoint product (Phi-3's qkv_proj and gate_up_proj,
GPT-NeoX's query_key_value) is one A shared by the parts and a B split by their rows: it is kept as each
part's (A, B rows), which adds the same products. A plain MLP (no gate) has up and down only.

A mixture-of-experts model's routed experts take adapters too (worker/lora/experts.py reads both forms PEFT
writes); their factors are kept per expert.

Every check runs before anything is kept, so a folder that fails leaves the worker as it was; each
failure is an InvalidParameterError naming the problem (the HTTP edge answers 400 with it).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from protocol.errors import InvalidParameterError
from worker.lora import experts as moe
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
    """One adapter's low-rank factors, scaled: module (layer, target) -> (A [rank, in], B [out, rank] x scale);
    experts: (layer, expert product) -> (A [E, rank, in], B [E, out, rank] x scale), every expert's."""

    rank: int
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        pairs = [*self.factors.values(), *self.experts.values()]
        return sum(a.nbytes + b.nbytes for a, b in pairs)


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


@dataclass(frozen=True)
class AdapterTargets:
    """What adapter_config.json names, by our names: the layers' products, the experts' products (target_modules
    on a mixture of experts' per-expert modules), and the experts' stacked parameters (target_parameters)."""

    rank: int
    scale: float
    products: set[str]
    expert_products: set[str]
    stacked: tuple[str, ...]


def read_adapter_config(path: str, max_rank: int, model: ModelConfig) -> AdapterTargets:
    """The targets of the folder's adapter_config.json, or an InvalidParameterError."""
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
    scale = float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)
    stacked = moe.target_parameters(model, config.get("target_parameters"))
    targets = config.get("target_modules")
    allowed = targets_of(model)
    expert_parts = set(moe.shapes(model)) if model.num_experts else set()
    if targets == "all-linear":
        return AdapterTargets(rank, scale, set(allowed), expert_parts, stacked)
    if stacked and not targets:  # the experts' parameters alone
        return AdapterTargets(rank, scale, set(), set(), stacked)
    if not isinstance(targets, list) or not targets:
        raise _refuse(
            f"target_modules {targets!r}: name the modules as a list (or 'all-linear'); "
            "a regular expression is not supported"
        )
    # peft matches a name or a dotted path's end ("model.layers.0.self_attn.q_proj" is a q_proj)
    wanted, experts, unknown = set(), set(), []
    for target in targets:
        leaf = str(target).rsplit(".", 1)[-1]
        ours = {
            our_module(model, f"model.layers.0.{part}.{leaf}") for part in ("self_attn", "mlp", "attention")
        }
        found = sorted(module[1] for module in ours if module is not None and module[1] in allowed)
        expert = moe.expert_module(our_name(model.family, f"model.layers.0.mlp.experts.0.{leaf}.weight"))
        if found:
            wanted.add(found[0])
        elif expert is not None and expert[2] in expert_parts:
            experts.add(expert[2])
        else:
            unknown.append(leaf)
    if unknown:
        served = (
            " (a mixture-of-experts model: its attention and its routed experts)" if model.num_experts else ""
        )
        names = [*allowed, *sorted(expert_parts)]
        raise _refuse(f"target modules {sorted(unknown)} are not supported; LoRA serves {names}{served}")
    return AdapterTargets(rank, scale, wanted, experts, stacked)


def load_adapter(path: str, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraWeights:
    """The adapter's factors in `dtype`, B scaled by lora_alpha / r (or / sqrt(r) with rsLoRA)."""
    wanted = read_adapter_config(path, max_rank, config)
    rank, scale = wanted.rank, wanted.scale
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise _refuse(f"{path} has no adapter_model.safetensors (only the safetensors format is read)")
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    stacked: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # target_parameters pairs
    per_expert: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _TENSOR.fullmatch(name)
            if match and (where := moe.stacked_part(match[1], wanted.stacked)) is not None:
                _check_layer(config, name, where[0], experts=True)
                stacked.setdefault(where, {})[match[2]] = f.get_tensor(name)
                continue
            expert = moe.expert_module(our_name(config.family, f"{match[1]}.weight")) if match else None
            if match and expert is not None:
                if expert[2] not in wanted.expert_products:
                    raise _refuse(
                        f"tensor {name!r} targets experts' {expert[2]}, which target_modules does not list"
                    )
                _check_layer(config, name, expert[0], experts=True)
                per_expert.setdefault(expert, {})[match[2]] = f.get_tensor(name)
                continue
            module = our_module(config, match[1]) if match else None
            if match is None or module is None:
                raise _refuse(
                    f"unexpected tensor {name!r} in the adapter (LoRA A/B of the decoder layers only)"
                )
            (layer, target), half = module, match[2]
            if target not in wanted.products:
                raise _refuse(f"tensor {name!r} targets {target}, which target_modules does not list")
            _check_layer(config, name, layer, experts=False)
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
    experts = moe.stack_modules(config, per_expert, rank)
    for (layer, param), pair in sorted(stacked.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(f"layer {layer} experts.{param} has lora_{''.join(pair)} without its other half")
        for expert_part, factor_pair in moe.split_stacked(
            config, layer, param, pair["A"], pair["B"], rank
        ).items():
            if (layer, expert_part) in experts:
                raise _refuse(f"layer {layer}: the experts' {expert_part} is in both of PEFT's forms")
            experts[(layer, expert_part)] = factor_pair
    experts = {key: (a.to(dtype), (b.float() * scale).to(dtype)) for key, (a, b) in experts.items()}
    if not factors and not experts:
        raise _refuse(f"{weights_path} holds no LoRA weights")
    return LoraWeights(rank, factors, experts)


def _check_layer(config: ModelConfig, name: str, layer: int, experts: bool) -> None:
    if layer >= config.num_layers:
        raise _refuse(f"tensor {name!r} is for layer {layer}; the base model has {config.num_layers}")
    if experts and not config.is_moe_layer(layer):
        raise _refuse(f"tensor {name!r} is for the experts of layer {layer}, whose MLP is dense")


def _checkpoint_rows(config: ModelConfig, layer: int, target: str, b: torch.Tensor) -> torch.Tensor:
    """B's rows in our order: the family's reordering of the product's weight (GPT-NeoX's heads)."""
    family = BY_NAME.get(config.family)
    if family is None or family.convert is None:
        return b
    section = "self_attn" if target in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    rows: torch.Tensor = family.convert(f"layers.{layer}.{section}.{target}.weight", b, config)
    return rows
