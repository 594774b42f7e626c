"""Tiny random Llama checkpoints quantized as AWQ, GPTQ and compressed-tensors write them, for the tests.
Each writer packs from its format's specification (AutoAWQ's GEMM packing with its column order, AutoGPTQ's
rows of input dims and zero points less one, compressed-tensors' pack_to_int32 with values plus 2^(bits-1)),
independently of worker/quant/formats.py, which reads them; and each returns the dequantized float32 model
(HF transformers, weights (q - zero) * scale) that is the oracle."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i holds column AWQ_PACK_ORDER[i] of 8
PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # products of one input


def tiny_llama(seed: int = 0, initializer_range: float = 0.3) -> Any:
    """Widths the 4-bit groups of 128 divide: hidden 128, MLP 256, q 128, k and v 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=initializer_range, tie_word_embeddings=False, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, scale_dtype: torch.dtype) -> tuple:  # type: ignore[type-arg]
    """w [N, K] -> (q [N, K] unsigned ints, scale [N, G] in scale_dtype, zero [N, G] unsigned ints): the
    weight (q - zero) * scale, round to nearest."""
    n, k = w.shape
    group = k if group == -1 else group
    wg = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scale = wg.abs().amax(-1) / ((1 << (bits - 1)) - 1)
        zero = torch.full_like(scale, 1 << (bits - 1))
    else:
        low, high = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (high - low) / top
        zero = torch.round(-low / scale).clamp(0, top)
    scale = scale.to(scale_dtype)
    q = torch.clamp(torch.round(wg / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1), 0, top)
    return q.reshape(n, k).to(torch.int64), scale, zero.to(torch.int64)


def dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    return (
        (q - zero.repeat_interleave(group, 1)).float() * scale.float().repeat_interleave(group, 1)
    ).float()


def pack_words(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """values [R, C] -> int32 [R, C * bits / 32], 32 / bits consecutive columns a word, column order[i] (or
    i) in the word's i-th field."""
    per = 32 // bits
    v = values.reshape(values.shape[0], -1, per).to(torch.int64)
    if order is not None:
        v = v[:, :, list(order)]
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        word |= (v[:, :, i] & ((1 << bits) - 1)) << (bits * i)
    return torch.from_numpy(word.numpy().astype(np.uint32).view(np.int32))


def write(model: Any, folder: str, method: str, **options: Any) -> Any:
    """Save `model` quantized with `method` ("awq", "gptq", "ct-pack", "ct-int8") into folder; returns the
    dequantized float32 HF model (the oracle). W8A8 ("ct-int8") quantizes activations too: the oracle's
    products quantize their inputs per token (symmetric int8, max |x| / 127, round half to even)."""
    from safetensors.torch import save_file

    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}  # (a tied lm_head: a copy)
    bits, group = options.get("bits", 4), options.get("group", 128)
    symmetric = options.get("symmetric", method == "ct-int8")
    scale_dtype = torch.bfloat16 if method.startswith("ct") else torch.float16
    act_order = options.get("act_order", False)
    rng = torch.Generator().manual_seed(3)
    orders: dict[str, torch.Tensor] = {}  # act_order "input": one order per input the products share
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in PRODUCTS:
            continue
        w = module.weight.detach()
        # act-order (GPTQ's desc_act, compressed-tensors' actorder "group"): the groups are formed over the
        # input dims in an order of their own; g_idx says each dim's group. GPTQ orders them by the input's
        # statistics, so products of one input (q, k and v; gate and up) share it: act_order="input"; True
        # gives each product an order of its own
        k = w.shape[1]
        stem, _, leaf = name.rpartition(".")
        shared_input = f"{stem}.{SHARED_INPUT.get(leaf, leaf)}"
        if act_order == "input" and shared_input in orders:
            order = orders[shared_input]
        else:
            order = torch.randperm(k, generator=rng) if act_order else torch.arange(k)
            orders[shared_input] = order
        q, scale, zero = quantize(w[:, order], bits, group, symmetric, scale_dtype)
        where = torch.empty_like(order)
        where[order] = torch.arange(k)  # where each input dim went
        q = q[:, where]  # back in the input dims' order
        g_idx = (where // (k // scale.shape[1])).to(torch.int32)
        with torch.no_grad():
            module.weight.copy_(dequantized(q[:, order], scale, zero)[:, where])
        del tensors[f"{name}.weight"]
        if method == "awq":
            tensors[f"{name}.qweight"] = pack_words(q.T, 4, AWQ_PACK_ORDER)
            tensors[f"{name}.qzeros"] = pack_words(zero.T, 4, AWQ_PACK_ORDER)
            tensors[f"{name}.scales"] = scale.T.contiguous()
        elif method == "gptq":
            shift = 0 if options.get("v2") else 1  # AutoGPTQ's v1 stores each zero point less one
            tensors[f"{name}.qweight"] = pack_words(q, bits).T.contiguous()  # input dims along the rows
            tensors[f"{name}.qzeros"] = pack_words(zero.T - shift, bits)
            tensors[f"{name}.scales"] = scale.T.contiguous()
            tensors[f"{name}.g_idx"] = g_idx
        elif method == "ct-pack":  # signed values plus 2^(bits - 1) (q here), packed along the input dims
            tensors[f"{name}.weight_packed"] = pack_words(q, bits)
            tensors[f"{name}.weight_scale"] = scale.contiguous()
            tensors[f"{name}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
            if act_order:
                tensors[f"{name}.weight_g_idx"] = g_idx
            if not symmetric:  # signed zero points plus 2^(bits - 1), packed along the output rows
                tensors[f"{name}.weight_zero_point"] = pack_words(zero.T, bits).T.contiguous()
        else:  # ct-int8: int8 weights as they are, per-channel scales
            tensors[f"{name}.weight"] = (q - 128).to(torch.int8)
            tensors[f"{name}.weight_scale"] = scale.float().contiguous()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    model.config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [type(model).__name__]
    config["quantization_config"] = quantization_config(method, bits, group, symmetric, options)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if method == "ct-int8":
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PRODUCTS:
                module.register_forward_pre_hook(lambda _, args: (int8_per_token(args[0]),))
    return model


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x / scale).round().clamp(-128, 127) * scale


def quantization_config(
    method: str, bits: int, group: int, symmetric: bool, options: dict[str, Any]
) -> dict[str, Any]:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}  # fmt: skip
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": bool(options.get("act_order")), "sym": symmetric,
                "damp_percent": 0.01, "true_sequential": True,
                "checkpoint_format": "gptq_v2" if options.get("v2") else "gptq"}  # fmt: skip
    strategy = "channel" if group == -1 else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": None if group == -1 else group, "dynamic": False,
               "actorder": "group" if options.get("act_order") else None}  # fmt: skip
    activations = None
    if method == "ct-int8":
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if method == "ct-pack" else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}}}  # fmt: skip
