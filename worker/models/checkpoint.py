"""A checkpoint's tensors into a CausalLM: the family's names mapped onto ours, the model's prefixes
dropped (a vision-language checkpoint's language model too; its vision tower is not ours to load), q/k/v
and gate/up stacked into our fused products (or taken fused, as Phi-3 ships them), per-head norm rows
(`name#h`), and every row of every parameter filled exactly once: a missing or a stray tensor is an error
naming it, never a model that runs on uninitialized weights."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from worker.model_config import ModelConfig
from worker.models.experts import Experts
from worker.models.families import BY_NAME, our_name
from worker.models.families.base import Family
from worker.models.layers import Embedding, Linear
from worker.quant.blocks import QuantPart, QuantWeight

IMAGE_SIDE = ("vision_tower.", "multi_modal_projector.")
# one expert's product, by our names (a family renames its own onto these)
EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# tensors a checkpoint may hold that no family computes with: rotary caches, a VLM's vision side, GPT-NeoX's
# old mask buffers
SKIPPED = (
    "rotary_emb.",
    "vision_tower.",
    "multi_modal_projector.",
    ".attention.bias",
    ".attention.masked_bias",
)


def load_checkpoint(
    model: nn.Module,
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight]],
    packed: bool = False,
) -> None:
    """model: a CausalLM of `config`; packed: the worker keeps quantized weights packed (a family's own
    combining, gpt-oss's MXFP4, gives them as blocks then)."""
    family = BY_NAME.get(config.family)
    # (a vision-language model's image side loads apart: worker/models/llava.py)
    params = {name: p for name, p in model.named_parameters() if not name.startswith(IMAGE_SIDE)}
    # rows filled: per row (an expert's rows for [experts, rows, cols] tensors), per element of a vector
    filled = {
        name: torch.zeros(tuple(param.shape[:2]) if param.dim() == 3 else param.shape[0] if param.dim() else 1,
                          dtype=torch.int32)
        for name, param in params.items()
    }  # fmt: skip
    moe_inter = config.moe_intermediate_size
    if family is not None and family.combine is not None:
        weights = family.combine(weights, config, packed)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    stacked = {
        "q_proj": ("qkv_proj", 0, q_size),
        "k_proj": ("qkv_proj", q_size, kv_size),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
    }
    if config.mlp == "gated":
        inter = config.intermediate_size
        stacked.update(gate_proj=("gate_up_proj", 0, inter), up_proj=("gate_up_proj", inter, inter))
    for checkpoint_name, tensor in weights:
        if any(part in checkpoint_name for part in SKIPPED):
            continue
        name = our_name(config.family, checkpoint_name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name, _, row = name.partition("#")
        if expert := EXPERT.match(name):  # one expert's product into the stacked [experts, ...] tensor
            prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
            target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in the model")
            start = moe_inter if part == "up_proj" else 0
            size = param.shape[1] if part == "down_proj" else moe_inter
            if isinstance(tensor, QuantWeight):  # kept packed, as that expert's product (Experts.add_quant)
                experts = model.get_submodule(prefix)
                if isinstance(experts, Experts) and tensor.shape == (size, param.shape[2]) and size % 16 == 0:
                    order = tensor.input_order()  # act-order: the product permutes its inputs
                    experts.add_quant(
                        index, part, QuantPart(start, tensor.qtype, tensor.packed(), size, order=order)
                    )
                    filled[target][index, start : start + size] += 1
                    continue
                tensor = tensor.dequantize()
            with torch.no_grad():
                param[index, start : start + size].copy_(tensor)
            filled[target][index, start : start + size] += 1
            continue
        target, rows = name, None
        for part, (merged, start, size) in stacked.items():
            if f".{part}." in name and name not in params:  # (MLA's q_proj is a product of its own)
                target, rows = name.replace(part, merged), (start, size)
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no place in the model")
        if target.endswith("gate_up_proj.weight") and rows is not None:  # a shared expert's width is its own
            half = param.shape[0] // 2
            rows = (0 if ".gate_proj." in name else half, half)
        if isinstance(tensor, QuantWeight):
            if _keep_packed(model, target, tensor, rows, family, config):
                filled[target][slice(None) if rows is None else slice(rows[0], rows[0] + rows[1])] += 1
                continue
            if tensor.activations is not None:
                raise ValueError(
                    f"{checkpoint_name!r} quantizes its activations (W8A8), which only its packed product does, "
                    f"and it cannot be kept packed here (shape {tensor.shape})"
                )
            tensor = tensor.dequantize()
        if family is not None and family.convert is not None:
            tensor = family.convert(target, tensor, config)
        with torch.no_grad():
            if row:
                param[int(row)].copy_(tensor.view(param.shape[1:]))
                filled[target][int(row)] += 1
            elif rows is None:
                param.copy_(tensor.view(param.shape))
                filled[target] += 1
            else:
                param[rows[0] : rows[0] + rows[1]].copy_(tensor)
                filled[target][rows[0] : rows[0] + rows[1]] += 1
    missing = [
        name for name, count in filled.items() if not bool((count == 1).all()) and not _tied(name, config)
    ]
    if missing:
        twice = [name for name in missing if bool((filled[name] > 1).any())]
        if twice:
            raise ValueError(f"checkpoint sets {len(twice)} tensors more than once, e.g. {sorted(twice)[:3]}")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _keep_packed(
    model: nn.Module,
    target: str,
    blocks: QuantWeight,
    rows: tuple[int, int] | None,
    family: Family | None,
    config: ModelConfig,
) -> bool:
    """Give a Linear or an Embedding a quantized weight as its tiles (QuantPart); False where the weight goes
    elsewhere (a router, stacked experts) or the family converts it otherwise than by moving whole rows."""
    input_order = blocks.input_order()  # act-order: the products permute their inputs (QuantPart.order)
    path, _, kind = target.rpartition(".")
    module = model.get_submodule(path) if kind == "weight" else None
    if not isinstance(module, (Linear, Embedding)) or blocks.shape[1] != module.weight.shape[1]:
        return False
    if input_order is not None and (not isinstance(module, Linear) or blocks.activations is not None):
        return False  # (an embedding's rows, or int8 activations, in the input dims' order: dequantized)
    if family is not None and family.convert is not None:
        probe = torch.arange(blocks.shape[0], dtype=torch.float64).unsqueeze(1)  # row i holds i
        moved = family.convert(target, probe, config)
        order = moved.reshape(-1).long().numpy()
        if moved.shape != probe.shape or sorted(order.tolist()) != list(range(blocks.shape[0])):
            return False
        blocks = blocks.with_rows(lambda r: r[order])
    start = 0 if rows is None else rows[0]
    if blocks.shape[0] != (module.weight.shape[0] if rows is None else rows[1]) or blocks.shape[0] % 16:
        return False  # (the tiles hold 16 rows side by side)
    if blocks.activations is not None and not isinstance(module, Linear):
        return False
    module.add_quant(
        QuantPart(start, blocks.qtype, blocks.packed(), blocks.shape[0], blocks.activations, input_order)
    )
    return True


def _tied(name: str, config: ModelConfig) -> bool:
    return name == "lm_head.weight" and config.tie_word_embeddings
