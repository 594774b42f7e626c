"""GGUF files of the decoder families, as llama.cpp's converter writes them: their metadata as a ModelConfig,
and their tensors under the Hugging Face names and layouts of the family's checkpoints (so that one loader
serves both), with what the converter changed undone: Llama-style q/k rows permuted for llama.cpp's rotary
(llama, granite, smollm3), Gemma's norms stored as 1 + w, GPT-NeoX's fused q/k/v regrouped, StableLM's
per-head norms stacked. What llama.cpp hard-codes rather than writes (Gemma 3's window pattern and local
rope base, SmolLM3's NoPE layers, Gemma's attention scale of the 27B models) is set as llama.cpp sets it.
A tensor or architecture this table does not know is an error naming it, never skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from worker.model_config import ModelConfig, UnsupportedModelError
from worker.models.families import BY_GGUF, BY_NAME
from worker.models.families.base import embedding_scale
from worker.models.families.gguf_deepseek import DEEPSEEK2_NAMES, deepseek2_options, join_kv_b
from worker.models.families.gguf_gpt_oss import (
    GPT_OSS_NAMES,
    MXFP4,
    gpt_oss_options,
    join_gate_up_bias,
    mxfp4_experts,
)
from worker.quant.blocks import GgufBlocks, QuantWeight
from worker.quant.gguf_pack import PACKED_TYPES, Q, can_pack, q3_k_as_q6_k

# llama.cpp's per-layer tensor names -> the HF checkpoint's (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixtures of experts: the router, every expert's products stacked [experts, out, in], a shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# where an architecture's names differ from the table above
ARCH_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
             "ffn_up": "mlp.gate_up_proj"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "gptneox": {"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
    "deepseek2": DEEPSEEK2_NAMES,
    "gpt-oss": GPT_OSS_NAMES,
}  # fmt: skip
NAMES_WHOLE = ("exp_probs_b", "attn_sinks")  # a `.bias` or `.weight` in the file, neither in the checkpoint
NAMES_BY_KIND = {
    ("gpt-oss", "ffn_down_exps", "bias"): "mlp.experts.down_proj_bias"
}  # [experts, hidden] whole
# tensors the converter split, joined back: the two parts, then (layer, first, second) -> (HF name, tensor)
JOINS: dict[str, tuple[tuple[str, str], Callable[[str, np.ndarray, np.ndarray], tuple[str, np.ndarray]]]] = {
    "deepseek2": (
        ("attn_k_b.weight", "attn_v_b.weight"),
        lambda layer, k_b, v_b: (f"model.layers.{layer}.self_attn.kv_b_proj.weight", join_kv_b(k_b, v_b)),
    ),
    "gpt-oss": (
        ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
        lambda layer, gate, up: (
            f"model.layers.{layer}.mlp.experts.gate_up_proj_bias",
            join_gate_up_bias(gate, up),
        ),
    ),
}
ARCH_OWN_EXPERTS = ("deepseek2", "gpt-oss")  # their ARCH_OPTIONS read the experts' fields themselves
ARCH_GLOBALS = {"gptneox": {"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
                            "output": "embed_out"}}  # fmt: skip
ARCH_PREFIX = {"gptneox": "gpt_neox.layers."}
PERMUTED = ("llama", "mistral", "granite", "smollm3")  # q/k rows interleaved for llama.cpp's rotary
FLOAT_TYPES = (int(Q.F32), int(Q.F16), int(Q.BF16))  # served as today (F16 and BF16 widened to float32)
GLOBAL_TENSORS_READ_AS_CONFIG = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class Metadata:
    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch = str(self.get("general.architecture"))
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def array(self, name: str) -> list[float]:
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        return [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type)).reshape(-1)]


def gguf_config(reader: Any) -> ModelConfig:
    meta = Metadata(reader)
    # Mixtral is llama.cpp's llama with experts
    family = (
        BY_NAME["mixtral"]
        if meta.arch == "llama" and meta.arch_get("expert_count")
        else BY_GGUF.get(meta.arch)
    )
    if family is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {meta.arch!r}; supported: {sorted(BY_GGUF)}"
        )
    hidden, heads = meta.arch_get("embedding_length"), meta.arch_get("attention.head_count")
    head_dim = meta.arch_get("attention.key_length") or hidden // heads
    rotary = meta.arch_get("rope.dimension_count") or head_dim
    eos = meta.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        family=family.name,
        vocab_size=meta.arch_get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        hidden_size=hidden,
        intermediate_size=meta.arch_get("feed_forward_length"),
        num_layers=meta.arch_get("block_count"),
        num_heads=heads,
        num_kv_heads=meta.arch_get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=meta.arch_get("attention.layer_norm_rms_epsilon")
        or meta.arch_get("attention.layer_norm_epsilon", 1e-6),
        rope_theta=float(meta.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, rotary),
        rotary_dim=0 if rotary == head_dim else rotary,
        max_position_embeddings=meta.arch_get("context_length", 2048),
        tie_word_embeddings="output.weight" not in meta.tensors,
        attention_bias="blk.0.attn_q.bias" in meta.tensors or "blk.0.attn_qkv.bias" in meta.tensors,
        o_bias="blk.0.attn_output.bias" in meta.tensors,
        mlp_bias="blk.0.ffn_down.bias" in meta.tensors,
        qk_norm="head" if "blk.0.attn_q_norm.weight" in meta.tensors else "",
        eos_token_ids=[] if eos is None else [int(eos)],
        # NOTE: GGUF weights are dequantized; "auto" serves them in bfloat16 like the models they came from.
        torch_dtype="bfloat16",
        architecture=meta.arch,
    )
    fields.update(ARCH_OPTIONS.get(meta.arch, _none)(meta, fields))
    if meta.arch_get("expert_count") and meta.arch not in ARCH_OWN_EXPERTS:
        fields.update(_experts(meta, fields))
    return ModelConfig(**fields)


def _experts(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts: llama.cpp's metadata, its dense layers those without a router, and top-k
    weights renormalized as llama.cpp does per architecture (qwen2moe alone does not)."""
    if meta.arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise UnsupportedModelError(f"GGUF {meta.arch}: experts are not supported for this architecture")
    layers = range(fields["num_layers"])
    shared = int(meta.arch_get("expert_shared_feed_forward_length", 0) or 0)
    return {
        "num_experts": int(meta.arch_get("expert_count")),
        "num_experts_per_tok": int(meta.arch_get("expert_used_count")),
        "moe_intermediate_size": int(
            meta.arch_get("expert_feed_forward_length") or fields["intermediate_size"]
        ),
        "norm_topk_prob": meta.arch != "qwen2moe",
        "shared_expert_intermediate_size": shared
        if any(n.endswith("ffn_up_shexp.weight") for n in meta.tensors)
        else 0,
        "dense_layers": [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in meta.tensors],
        "shared_expert_gate": any(n.endswith("ffn_gate_inp_shexp.weight") for n in meta.tensors),
    }


def _rope_scaling(meta: Metadata, rotary: int) -> dict[str, Any] | None:
    kind = meta.arch_get("rope.scaling.type")
    original = meta.arch_get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in meta.tensors:  # llama3's per-frequency divisors, as llama.cpp computed them
        return {"rope_type": "freq_factors", "factors": meta.array("rope_freqs.weight")}
    if "rope_factors_short.weight" in meta.tensors:  # Phi-3's LongRoPE
        return {
            "rope_type": "longrope",
            "short_factor": meta.array("rope_factors_short.weight"),
            "long_factor": meta.array("rope_factors_long.weight"),
            "original_max_position_embeddings": original,
            "max_position_embeddings": meta.arch_get("context_length"),
            "attention_factor": meta.arch_get("rope.scaling.attn_factor"),
        }
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.arch_get("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(meta.arch_get("rope.scaling.factor")),
            "original_max_position_embeddings": original,
            "attention_factor": meta.arch_get("rope.scaling.yarn_attn_factor"),
            "beta_fast": meta.arch_get("rope.scaling.yarn_beta_fast"),
            "beta_slow": meta.arch_get("rope.scaling.yarn_beta_slow"),
            "truncate": True,
        }
        return {k: v for k, v in scaling.items() if v is not None}
    raise UnsupportedModelError(f"GGUF {meta.arch}: rope scaling type {kind!r} is not supported")


def _none(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {}


def _gemma(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"norm": "rms_offset", "embedding_multiplier": embedding_scale(fields["hidden_size"]),
            "hidden_act": "gelu_tanh", "tie_word_embeddings": True}  # fmt: skip


def _gemma_scale(fields: dict[str, Any], layers_27b: int) -> float:
    """llama.cpp's rule: the 27B model's query_pre_attn_scalar is hidden / heads, the others' head_dim."""
    scalar = (
        fields["hidden_size"] // fields["num_heads"]
        if fields["num_layers"] == layers_27b
        else fields["head_dim"]
    )
    return 1.0 / math.sqrt(scalar)


def _gemma2(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(fields["num_layers"])]
    return {**_gemma(meta, fields), "layout": "sandwich", "attention_scale": _gemma_scale(fields, 46),
            "attn_softcap": float(meta.arch_get("attn_logit_softcapping", 50.0)),
            "final_softcap": float(meta.arch_get("final_logit_softcapping", 30.0)),
            "sliding_window": int(meta.arch_get("attention.sliding_window", 4096)), "layer_types": kinds}  # fmt: skip


def _gemma3(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    window = int(meta.arch_get("attention.sliding_window", 0) or 0)
    kinds = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(fields["num_layers"])]
    return {**_gemma(meta, fields), "layout": "sandwich", "attention_scale": _gemma_scale(fields, 62),
            "final_softcap": float(meta.arch_get("final_logit_softcapping", 0.0) or 0.0),
            "sliding_window": window, "layer_types": kinds if window else [],
            "rope_local_theta": 10000.0 if window else 0.0}  # fmt: skip


def _phi3(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": int(meta.arch_get("attention.sliding_window", 0) or 0)}


def _granite(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    logit_scale = float(meta.arch_get("logit_scale", 1.0) or 1.0)
    return {"embedding_multiplier": float(meta.arch_get("embedding_scale", 1.0) or 1.0),
            "residual_multiplier": float(meta.arch_get("residual_scale", 1.0) or 1.0),
            "attention_scale": float(meta.arch_get("attention.scale", 0.0) or 0.0),
            "logits_scale": 1.0 / logit_scale}  # fmt: skip


def _olmo2(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    window = int(meta.arch_get("attention.sliding_window", 0) or 0)
    pattern = meta.arch_get("attention.sliding_window_pattern")
    kinds = (
        ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
        if window and pattern
        else []
    )
    return {"layout": "post", "qk_norm": "proj", "sliding_window": window if kinds else 0, "layer_types": kinds,
            "rope_local_theta": float(meta.arch_get("rope.freq_base_swa", 0.0) or 0.0) if kinds else 0.0}  # fmt: skip


def _smollm3(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"nope_layers": [i for i in range(fields["num_layers"]) if (i + 1) % 4 == 0]}  # llama.cpp's


def _glm4(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"layout": "sandwich", "rope_interleaved": True}


def _command_r(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"norm": "cohere", "layout": "parallel_shared", "rope_interleaved": True, "tie_word_embeddings": True,
            "logits_scale": float(meta.arch_get("logit_scale", 1.0)),
            "qk_norm": "head_each" if fields["qk_norm"] else "", "o_bias": fields["attention_bias"]}  # fmt: skip


def _starcoder2(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    return {"norm": "layer", "norm_bias": True, "mlp": "plain", "hidden_act": "gelu_tanh"}


def _gptneox(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    parallel = bool(meta.arch_get("use_parallel_residual", True))
    return {"norm": "layer", "norm_bias": True, "mlp": "plain", "hidden_act": "gelu",
            "layout": "parallel" if parallel else "pre"}  # fmt: skip


def _stablelm(meta: Metadata, fields: dict[str, Any]) -> dict[str, Any]:
    parallel = "blk.0.ffn_norm.weight" not in meta.tensors  # llama.cpp decides by the tensor, as here
    return {"norm": "layer", "norm_bias": True, "layout": "parallel_shared" if parallel else "pre",
            "qk_norm": "head_each" if fields["qk_norm"] else ""}  # fmt: skip


ARCH_OPTIONS: dict[str, Callable[[Metadata, dict[str, Any]], dict[str, Any]]] = {
    "gemma": _gemma, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "granite": _granite, "olmo2": _olmo2,
    "smollm3": _smollm3, "glm4": _glm4, "command-r": _command_r, "starcoder2": _starcoder2, "gptneox": _gptneox,
    "stablelm": _stablelm, "deepseek2": deepseek2_options, "gpt-oss": gpt_oss_options,
}  # fmt: skip


def gguf_tensors(
    reader: Any, config: ModelConfig, progress: bool = True, packed: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(HF checkpoint name, float32 tensor in the HF layout) of every tensor of the file; packed: a quantized
    [N, K] weight stays the file's blocks (GgufBlocks, its rows in the HF order), and a type the products do
    not take packed is an error naming it and the tensor."""
    from gguf.quants import dequantize

    arch = Metadata(reader).arch
    desc = "Reading GGUF tensors" if packed else "Dequantizing GGUF tensors"
    parts, join = JOINS[arch] if arch in JOINS else (("", ""), None)
    halves: dict[str, dict[str, np.ndarray]] = {}  # a layer's split tensor until both parts came
    for tensor in tqdm(reader.tensors, desc=desc, disable=not progress):
        if tensor.name in GLOBAL_TENSORS_READ_AS_CONFIG:
            continue  # read into the config's rope_scaling
        _, layer, part = tensor.name.split(".", 2) if tensor.name.startswith("blk.") else ("", "", "")
        if join is not None and part in parts:
            half = halves.setdefault(layer, {})
            half[part] = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if len(half) == 2:
                name, joined = join(layer, half.pop(parts[0]), half.pop(parts[1]))
                yield name, torch.from_numpy(joined)
            continue
        name = hf_name(arch, tensor.name)
        qtype = int(tensor.tensor_type)
        if packed and qtype not in FLOAT_TYPES:
            shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the dims innermost first
            if qtype == MXFP4 and len(shape) == 3 and ".experts." in name:  # gpt-oss's experts
                yield from mxfp4_experts(name, np.asarray(tensor.data), shape)
                continue
            raw = np.asarray(tensor.data)
            if qtype == int(Q.Q3_K):  # served as the Q6_K blocks of the same values (q3_k_as_q6_k)
                raw, qtype = q3_k_as_q6_k(raw), int(Q.Q6_K)
            if int(qtype) not in PACKED_TYPES:
                raise UnsupportedModelError(
                    f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, which is not served packed "
                    f"(packed: {', '.join(Q(t).name for t in PACKED_TYPES)}, Q3_K as Q6_K); --quantization none dequantizes it"
                )
            if len(shape) == 2 and can_pack(qtype, shape) and name.endswith(".weight"):
                rows = raw.reshape(shape[0], -1)
                yield from _as_hf(arch, name, GgufBlocks(qtype, rows, (shape[0], shape[1])), config)
                continue
            if (
                len(shape) == 3
                and ".experts." in name
                and can_pack(qtype, shape[1:])
                and not config.expert_bias
            ):
                # stacked experts [experts, out, in]: each expert's blocks, as HF checkpoints name them
                stem, _, part = name.rpartition(".experts.")
                stacked = raw.reshape(shape[0], shape[1], -1)
                for expert in range(shape[0]):
                    blocks = GgufBlocks(qtype, stacked[expert], (shape[1], shape[2]))
                    yield f"{stem}.experts.{expert}.{part}", blocks
                continue
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # [out, in]
        yield from _as_hf(arch, name, weights, config)
    if any(halves.values()):
        raise UnsupportedModelError(
            f"GGUF {arch}: {' or '.join(parts)} without the other in layers {sorted(halves)}"
        )


def hf_name(arch: str, name: str) -> str:
    if match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        layer, part, kind = match.groups()
        hf = ARCH_NAMES.get(arch, {}).get(part) or LAYER_NAMES.get(part)
        if hf is not None:
            if (arch, part, kind) in NAMES_BY_KIND:
                hf = NAMES_BY_KIND[arch, part, kind]
            suffix = "" if part in NAMES_WHOLE or (arch, part, kind) in NAMES_BY_KIND else f".{kind}"
            return f"{ARCH_PREFIX.get(arch, 'model.layers.')}{layer}.{hf}{suffix}"
    elif match := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        part, kind = match.groups()
        hf = ARCH_GLOBALS.get(arch, {}).get(part) or GLOBAL_NAMES.get(part)
        if hf is not None:
            return f"{hf}.{kind}"
    raise UnsupportedModelError(f"GGUF {arch}: tensor {name!r} is not one we know how to load")


def _as_hf(
    arch: str, name: str, weights: np.ndarray | GgufBlocks, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
    if isinstance(weights, GgufBlocks):  # only whole rows move: what moves more is dequantized
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            weights = weights.with_rows(lambda rows: _undo_rope_permute(rows, heads))
        elif arch == "gptneox" and ".query_key_value." in name:
            weights = weights.with_rows(lambda rows: _regroup_neox(rows, config.num_heads))
        yield name, weights  # (stacked experts come as each expert's blocks: gguf_tensors)
        return
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        weights = _undo_rope_permute(weights, config.num_heads if ".q_proj." in name else config.num_kv_heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        weights = weights - 1.0  # the converter stores 1 + w
    if arch == "gptneox" and ".query_key_value." in name:  # [q | k | v] of all heads -> per head
        weights = _regroup_neox(weights, config.num_heads)
    if ".experts." in name and not name.endswith("_bias"):  # [experts, out, in] -> one tensor per expert
        stem, _, part = name.rpartition(".experts.")
        for expert, rows in enumerate(weights):
            yield f"{stem}.experts.{expert}.{part}", torch.from_numpy(np.array(rows, dtype=np.float32))
        return
    if arch == "stablelm" and name.endswith(("q_norm.weight", "k_norm.weight")):  # stacked -> one per head
        which = "q" if name.endswith("q_norm.weight") else "k"
        for head, row in enumerate(weights.reshape(-1, config.head_dim)):
            yield (
                name.replace(f"{which}_norm.weight", f"{which}_layernorm.norms.{head}.weight"),
                torch.from_numpy(row.copy()),
            )
        return
    yield name, torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy


def _regroup_neox(weights: np.ndarray, heads: int) -> np.ndarray:
    return weights.reshape(3, heads, -1, *weights.shape[1:]).swapaxes(0, 1).reshape(weights.shape)


def _undo_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; restore HF's half-split order."""
    head_dim_half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, head_dim_half, 2, *weights.shape[1:])  # [heads, half, 2, in]
    return w.swapaxes(1, 2).reshape(weights.shape)
