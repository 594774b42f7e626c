"""A GGUF file of a tiny HF checkpoint, written as llama.cpp's convert_hf_to_gguf.py writes one (float32):
its metadata keys, its tensor names, and its changes to the weights (q/k rows permuted for llama.cpp's
rotary, Gemma's norms stored as 1 + w, GPT-NeoX's fused q/k/v regrouped, StableLM's per-head norms
stacked). Read back by worker/models/families/gguf.py, the model must be the checkpoint's."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

# HF name (after "model.layers.N.") -> llama.cpp's, per architecture where they differ
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp", "block_sparse_moe.experts.w1": "ffn_gate_exps",
    "block_sparse_moe.experts.w3": "ffn_up_exps", "block_sparse_moe.experts.w2": "ffn_down_exps",
}  # fmt: skip
ARCH_LAYER = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "glm4": {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
             "mlp.gate_up_proj": "ffn_up"},
    "phi3": {"mlp.gate_up_proj": "ffn_up"},
    "starcoder2": {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "gptneox": {"attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
                "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"},
}  # fmt: skip
ARCH_LAYER["gemma3"] = ARCH_LAYER["gemma2"]
ARCH_LAYER["deepseek2"] = {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
          "gpt_neox.embed_in": "token_embd", "gpt_neox.final_layer_norm": "output_norm", "embed_out": "output"}  # fmt: skip
PERMUTED = ("llama", "granite", "smollm3")
Quantize = Callable[[str, np.ndarray], Any]


def write_gguf(
    folder: str, arch: str, path: str, quantize: Quantize | None = None, split_kv_b: bool = True
) -> None:
    """quantize(llama.cpp's tensor name, its float32 values): the GGML type to store it in, or None for
    float32, or (type, the blocks' bytes); a type the `gguf` package cannot quantize to is written as zero
    blocks (a refusal's test).
    split_kv_b: deepseek2's kv_b_proj as today's converter writes it (attn_k_b and attn_v_b), or whole
    (attn_kv_b) as files converted before mid-2025 hold it."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    tensors = load_file(str(pathlib.Path(folder) / "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, config, split_kv_b)
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in sorted(tensors.items()):
        data = tensor.float().numpy()
        if arch == "gpt-oss" and _gpt_oss_tensor(writer, name, data, quantize):
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        if arch in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            data = _permute(data, heads if ".q_proj." in name else kv_heads)
        if arch == "gptneox" and ".query_key_value." in name:  # per head [q k v] -> [q of all | k | v]
            data = data.reshape(heads, 3, -1, *data.shape[1:]).swapaxes(0, 1).reshape(data.shape)
        if ".experts." in name:  # one expert's product -> the layer's [experts, out, in] (convert_hf_to_gguf)
            stem, _, rest = name.partition(".experts.")
            expert, _, part = rest.partition(".")
            stacked.setdefault(f"{stem}.experts.{part.removesuffix('.weight')}", {})[int(expert)] = data
            continue
        if name.endswith("shared_expert_gate.weight"):  # [1, hidden] -> [hidden], as llama.cpp reads it
            data = data.reshape(-1)
        if name.endswith(".mlp.gate.e_score_correction_bias"):  # the converter's exp_probs_b, a `.bias`
            writer.add_tensor(f"blk.{name.split('.')[2]}.exp_probs_b.bias", data)
            continue
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight") and split_kv_b:
            # per head [nope + v, rank] -> attn_k_b [heads, rank, nope] (transposed) and attn_v_b [heads, v, rank]
            nope, rank = config["qk_nope_head_dim"], config["kv_lora_rank"]
            per_head = data.reshape(heads, -1, rank)
            block = f"blk.{name.split('.')[2]}"
            _add(
                writer,
                f"{block}.attn_k_b.weight",
                np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)),
                quantize,
            )
            _add(writer, f"{block}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]), quantize)
            continue
        if arch == "stablelm" and "_layernorm.norms." in name:
            which, head = ("q" if ".q_layernorm." in name else "k"), int(name.split(".")[-2])
            stacked.setdefault(f"{name.split('.self_attn.')[0]}.self_attn.{which}_norm", {})[head] = data
            continue
        _add(writer, _gguf_name(arch, name), data, quantize)
    for prefix, rows in stacked.items():
        data = np.stack([rows[h] for h in sorted(rows)])
        if ".experts." in prefix:  # [experts, out, in], quantized as one tensor (llama.cpp's *_exps)
            _add(writer, _gguf_name(arch, f"{prefix}.weight"), data, quantize)
        else:
            writer.add_tensor(_gguf_name(arch, f"{prefix}.weight"), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer: Any, name: str, data: np.ndarray, quantize: Quantize | None) -> None:
    import gguf
    from gguf.quants import quantize as gguf_quantize

    qtype = quantize(name, data) if quantize is not None else None
    if qtype is None:
        writer.add_tensor(name, data)
        return
    if isinstance(qtype, tuple):  # (type, the file's bytes): blocks the gguf package cannot make
        writer.add_tensor(name, qtype[1], raw_dtype=qtype[0])
        return
    try:
        blocks = gguf_quantize(data, qtype)
    except NotImplementedError:
        size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.zeros((*data.shape[:-1], data.shape[-1] // size * nbytes), dtype=np.uint8)
    writer.add_tensor(name, blocks, raw_dtype=qtype)


def _gguf_name(arch: str, name: str) -> str:
    for prefix in ("model.layers.", "gpt_neox.layers."):
        if name.startswith(prefix):
            layer, _, rest = name[len(prefix) :].partition(".")
            part, _, kind = rest.rpartition(".")
            return f"blk.{layer}.{ARCH_LAYER.get(arch, {}).get(part) or LAYER[part]}.{kind}"
    part, _, kind = name.rpartition(".")
    return f"{GLOBAL[part]}.{kind}"


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _metadata(writer: Any, arch: str, config: dict[str, Any], split_kv_b: bool = True) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    if arch == "deepseek2":
        _deepseek2_metadata(writer, config, rope, split_kv_b)
    elif arch == "gpt-oss":  # GptOssModel.set_gguf_parameters, and the base class's YaRN keys
        writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
        writer.add_uint32(f"{arch}.expert_count", config["num_local_experts"])
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config["intermediate_size"])
        _yarn_metadata(writer, arch, rope)
    else:
        writer.add_uint32(f"{arch}.attention.head_count_kv", config.get("num_key_value_heads") or heads)
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.vocab_size", config["vocab_size"])
    eps = config.get("rms_norm_eps") or 1e-6
    if arch in ("starcoder2", "gptneox", "stablelm", "command-r"):
        eps = config.get("norm_epsilon") or config.get("layer_norm_eps") or 1e-5
        writer.add_float32(f"{arch}.attention.layer_norm_epsilon", eps)
    else:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", eps)
    if arch not in ("gemma", "gemma2", "gptneox", "stablelm"):  # as the converters: these write no base
        writer.add_float32(f"{arch}.rope.freq_base", float(rope.get("rope_theta", 10000.0)))
    partial = (
        rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or config.get("rotary_pct")
    )
    if partial:
        writer.add_uint32(f"{arch}.rope.dimension_count", int(head_dim * partial))
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    if config.get("sliding_window") and arch in ("gemma2", "gemma3", "phi3"):
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    if arch == "granite":
        writer.add_float32(f"{arch}.attention.scale", config["attention_multiplier"])
        writer.add_float32(f"{arch}.embedding_scale", config["embedding_multiplier"])
        writer.add_float32(f"{arch}.residual_scale", config["residual_multiplier"])
        writer.add_float32(f"{arch}.logit_scale", config["logits_scaling"])
    if arch == "command-r":
        writer.add_float32(f"{arch}.logit_scale", config["logit_scale"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts and arch not in ("deepseek2", "gpt-oss"):
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_uint32(
                f"{arch}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"]
            )
    if arch == "gptneox":
        writer.add_bool(f"{arch}.use_parallel_residual", config.get("use_parallel_residual", True))


def _deepseek2_metadata(writer: Any, config: dict[str, Any], rope: dict[str, Any], split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: one KV head (the latent), the MLA lengths, the experts, YaRN's
    mscale_all_dim as 0.1 times itself."""
    arch, rank, rope_dim = "deepseek2", config["kv_lora_rank"], config["qk_rope_head_dim"]
    key, value = config["qk_nope_head_dim"] + rope_dim, config["v_head_dim"]
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    writer.add_uint32(f"{arch}.leading_dense_block_count", config["first_k_dense_replace"])
    if config.get("q_lora_rank"):
        writer.add_uint32(f"{arch}.attention.q_lora_rank", config["q_lora_rank"])
    writer.add_uint32(f"{arch}.attention.kv_lora_rank", rank)
    if split_kv_b:
        writer.add_uint32(f"{arch}.attention.key_length", rank + rope_dim)
        writer.add_uint32(f"{arch}.attention.value_length", rank)
        writer.add_uint32(f"{arch}.attention.key_length_mla", key)
        writer.add_uint32(f"{arch}.attention.value_length_mla", value)
    else:
        writer.add_uint32(f"{arch}.attention.key_length", key)
        writer.add_uint32(f"{arch}.attention.value_length", value)
    writer.add_uint32(f"{arch}.rope.dimension_count", rope_dim)
    writer.add_uint32(f"{arch}.expert_count", config["n_routed_experts"])
    writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
    writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    writer.add_uint32(f"{arch}.expert_shared_count", config.get("n_shared_experts") or 0)
    writer.add_float32(f"{arch}.expert_weights_scale", config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_bool(f"{arch}.expert_weights_norm", True)
    v3 = config["architectures"][0].startswith("DeepseekV3")
    writer.add_uint32(
        f"{arch}.expert_gating_func", 2 if v3 else 1
    )  # sigmoid (V3's configs say so) or softmax
    writer.add_uint32(f"{arch}.expert_group_count", config.get("n_group") or 1)
    writer.add_uint32(f"{arch}.expert_group_used_count", config.get("topk_group") or 1)
    if rope.get("rope_type") == "yarn":
        _yarn_metadata(writer, arch, rope)
        writer.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])


def _yarn_metadata(writer: Any, arch: str, rope: dict[str, Any]) -> None:
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    writer.add_uint32(
        f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"]
    )
    writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
    writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])


GPT_OSS = {"self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
           "mlp.router.bias": "ffn_gate_inp.bias", "post_attention_layernorm.weight": "post_attention_norm.weight",
           "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}  # fmt: skip


def _gpt_oss_tensor(writer: Any, name: str, data: np.ndarray, quantize: Quantize | None) -> bool:
    """GptOssModel.modify_tensors on a float checkpoint: the experts' [E, H, 2I] gate_up de-interleaved and
    transposed into ffn_gate_exps and ffn_up_exps [E, I, H], down_proj [E, I, H] into [E, H, I], the biases
    apart; the router, the sinks and the post-attention norm by their names. False: the shared table's."""
    if not name.startswith("model.layers."):
        return False
    layer, rest = name.split(".")[2], name.split(".", 3)[3]
    block = f"blk.{layer}"
    if rest == "mlp.experts.gate_up_proj":
        both = data.transpose(0, 2, 1)
        _add(writer, f"{block}.ffn_gate_exps.weight", np.ascontiguousarray(both[:, 0::2]), quantize)
        _add(writer, f"{block}.ffn_up_exps.weight", np.ascontiguousarray(both[:, 1::2]), quantize)
    elif rest == "mlp.experts.gate_up_proj_bias":
        writer.add_tensor(f"{block}.ffn_gate_exps.bias", np.ascontiguousarray(data[:, 0::2]))
        writer.add_tensor(f"{block}.ffn_up_exps.bias", np.ascontiguousarray(data[:, 1::2]))
    elif rest == "mlp.experts.down_proj":
        _add(writer, f"{block}.ffn_down_exps.weight", np.ascontiguousarray(data.transpose(0, 2, 1)), quantize)
    elif rest in GPT_OSS:
        writer.add_tensor(f"{block}.{GPT_OSS[rest]}", data)
    else:
        return False
    return True
