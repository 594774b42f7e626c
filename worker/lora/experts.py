"""A LoRA adapter's factors on the routed experts of a mixture-of-experts model, in either of the two forms
PEFT writes them:

- one pair per stacked parameter (PEFT's `target_parameters`, the form transformers 5's fused experts take):
  `...mlp.experts.lora_A.weight` [r x E, in] and `lora_B.weight` [out, r x E] for the outermost parameter,
  `...experts.base_layer.lora_A.weight` for the one it wraps, and so on. PEFT wraps the targeted parameters
  in the order the module declares them (gate_up_proj, then down_proj), so the last declared is outermost.
  Expert e's factors are A.view(E, r, in)[e] and B.view(out, r, E)[:, :, e] (PEFT's get_delta_weight);
- one pair per expert and product (per-expert Linear modules, transformers 4's layout and the names vLLM
  reads): `...experts.<e>.gate_proj.lora_A.weight` [r, in], under the family's names (Mixtral's w1/w3/w2).

gpt-oss stores its experts [E, in, out] with gate and up columns interleaved: B's rows are put gate first,
as the checkpoint's weight is (worker/models/families/gpt_oss.py). The router, a shared expert and the dense
MLP layers of such a model take no adapter: a tensor on them is refused by name.
"""

from __future__ import annotations

import re

import torch

from protocol.errors import InvalidParameterError
from worker.model_config import ModelConfig

# the experts' products an adapter may target, by the stacked parameter of ours each is part of
EXPERT_PARTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
STACKED = ("gate_up_proj", "down_proj")  # the stacked parameters, in the order the modules declare them
TRANSPOSED = ("gpt_oss",)  # families whose stacked experts are [E, in, out], gate and up interleaved
_STACKED_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)"
)
_EXPERT_MODULE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _refuse(message: str) -> InvalidParameterError:
    return InvalidParameterError("lora_path", message)


def target_parameters(config: ModelConfig, listed: object) -> tuple[str, ...]:
    """adapter_config.json's `target_parameters` -> the stacked parameters it names (in STACKED's order)."""
    if not listed:
        return ()
    served = (
        "LoRA on parameters serves a mixture-of-experts model's experts.gate_up_proj and experts.down_proj"
    )
    if not config.num_experts or not isinstance(listed, list):
        raise _refuse(f"target_parameters {listed!r}: {served}")

    def leaf(entry: object) -> str | None:
        return next((name for name in STACKED if re.fullmatch(rf"(.+\.)?experts\.{name}", str(entry))), None)

    unknown = sorted(str(entry) for entry in listed if leaf(entry) is None)
    if unknown:
        raise _refuse(f"target_parameters {unknown} are not supported; {served}")
    return tuple(name for name in STACKED if name in {leaf(entry) for entry in listed})


def stacked_part(path: str, wanted: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer, stacked parameter) of a tensor path in the target_parameters form, or None if not one."""
    match = _STACKED_TENSOR.fullmatch(path)
    if match is None or not wanted:
        return None
    depth = match[2].count(".base_layer")
    if depth >= len(wanted):
        return None
    return int(match[1]), wanted[len(wanted) - 1 - depth]


def expert_module(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, product) of a per-expert module's weight name (our names), or None."""
    match = _EXPERT_MODULE.fullmatch(name)
    return (int(match[1]), int(match[2]), match[3]) if match else None


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """An expert's product -> (in_features, out_features)."""
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def split_stacked(
    config: ModelConfig, layer: int, stacked: str, a: torch.Tensor, b: torch.Tensor, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A target_parameters pair -> each of our parts' (A [E, r, in], B [E, out, r]), unscaled."""
    experts, size = config.num_experts, shapes(config)
    parts = EXPERT_PARTS["gate_up" if stacked == "gate_up_proj" else "down"]
    in_features = size[parts[0]][0]
    out_features = sum(size[part][1] for part in parts)
    if tuple(a.shape) != (rank * experts, in_features) or tuple(b.shape) != (out_features, rank * experts):
        raise _refuse(
            f"layer {layer} experts.{stacked}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
            f"{experts} experts of {out_features} x {in_features} at rank {rank}"
        )
    a_e = a.view(experts, rank, in_features)
    b_e = b.view(out_features, rank, experts).permute(2, 0, 1)  # [E, out, r]
    if config.family in TRANSPOSED and stacked == "gate_up_proj":  # interleaved gate and up rows: gate first
        b_e = torch.cat([b_e[:, 0::2], b_e[:, 1::2]], dim=1)
    rows = torch.split(b_e, [size[part][1] for part in parts], dim=1)
    return {part: (a_e, part_rows) for part, part_rows in zip(parts, rows, strict=True)}


def stack_modules(
    config: ModelConfig, modules: dict[tuple[int, int, str], dict[str, torch.Tensor]], rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per-expert pairs {(layer, expert, part): {"A", "B"}} -> (layer, part): (A [E, r, in], B [E, out, r]),
    zeros for the experts the adapter leaves out."""
    size, stacked = shapes(config), {}
    for layer, part in sorted({(layer, part) for layer, _, part in modules}):
        in_features, out_features = size[part]
        a = torch.zeros(config.num_experts, rank, in_features)
        b = torch.zeros(config.num_experts, out_features, rank)
        for (at, expert, name), pair in modules.items():
            if (at, name) != (layer, part):
                continue
            if expert >= config.num_experts:
                raise _refuse(
                    f"layer {layer} experts.{expert}.{part}: the base model has {config.num_experts} experts"
                )
            if set(pair) != {"A", "B"}:
                raise _refuse(
                    f"layer {layer} experts.{expert}.{part} has lora_{''.join(pair)} without its other half"
                )
            if tuple(pair["A"].shape) != (rank, in_features) or tuple(pair["B"].shape) != (
                out_features,
                rank,
            ):
                raise _refuse(
                    f"layer {layer} experts.{expert}.{part}: lora_A {tuple(pair['A'].shape)} and lora_B "
                    f"{tuple(pair['B'].shape)} do not fit the base model ({out_features} x {in_features}) at rank {rank}"
                )
            a[expert], b[expert] = pair["A"], pair["B"]
        stacked[(layer, part)] = (a, b)
    return stacked
