"""Whisper's checkpoint into its stacked products (worker/models/whisper.py): transformers' names, each
self-attention's q, k and v into one product, every decoder layer's cross-attention k and v into another."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from worker.model_config import ModelConfig


def load_whisper_weights(
    params: dict[str, nn.Parameter], config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Into the model's named parameters, from Hugging Face names: model.encoder.*, model.decoder.*,
    proj_out (the embedding, tied); each self-attention's q, k and v into its stacked qkv, the
    cross-attentions' k and v into cross_kv."""
    hidden = config.hidden_size
    scale = config.head_dim**-0.5
    with torch.no_grad():  # k has no bias: its part of a stacked bias stays zero
        for name, stacked in params.items():
            if name.endswith(("qkv.bias", "cross_kv.bias")):
                stacked.zero_()
    loaded: set[str] = set()
    for name, tensor in weights:
        target = name.removeprefix("model.").replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2.")
        if target == "proj_out.weight":
            continue  # tied to the decoder's embedding (finalize)
        target, offset = stacked_place(target, hidden)
        param = params.get(target)
        if param is None or (offset is not None and tensor.shape[0] != hidden):
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        with torch.no_grad():
            if offset is None:
                param.copy_(tensor.view(param.shape))
            else:
                q = ".qkv." in target and offset == 0 and folds(scale)
                param[offset : offset + hidden].copy_(tensor * scale if q else tensor)  # exact: 2^-k
        loaded.add(target if offset is None else f"{target}#{offset}")
    expected = set()
    for name, param in params.items():
        if ".qkv." not in name and not name.startswith("cross_kv."):
            expected.add(name)
            continue
        for part in range(param.shape[0] // hidden):  # k (part 1 of a qkv, even parts of cross_kv): no bias
            is_k = part == 1 if ".qkv." in name else part % 2 == 0
            if name.endswith("weight") or not is_k:
                expected.add(f"{name}#{part * hidden}")
    missing = expected - loaded - {"proj_out.weight"}
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def stacked_place(target: str, hidden: int) -> tuple[str, int | None]:
    """Our parameter for a checkpoint tensor, and its first row when it is one part of a stacked product:
    a self-attention's q/k/v_proj (parts 0, 1, 2 of its qkv), decoder layer i's encoder_attn k/v_proj
    (parts 2i, 2i + 1 of cross_kv)."""
    head, _, tail = target.rpartition(".")  # tail: weight or bias
    for part, index in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
        if head.endswith(f".self_attn.{part}"):
            return f"{head.removesuffix(part)}qkv.{tail}", index * hidden
    if head.startswith("decoder.layers.") and head.endswith((".encoder_attn.k_proj", ".encoder_attn.v_proj")):
        layer = int(head.split(".")[2])
        return f"cross_kv.{tail}", (2 * layer + head.endswith("v_proj")) * hidden
    return target, None


def folds(scale: float) -> bool:
    """A power of two: scaling a product's rows by it gives the scaled product's values exactly."""
    return scale > 0 and math.frexp(scale)[0] == 0.5
