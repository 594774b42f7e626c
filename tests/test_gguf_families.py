"""Each family's GGUF file, as llama.cpp's converter writes it (tests/gguf_writer.py: its names, metadata
and changes to the weights), loads as the checkpoint it came from: the same greedy tokens and logprobs as
HF transformers on the checkpoint. The tiny checkpoints follow what llama.cpp hard-codes (Gemma 3's window
pattern and local rope base, SmolLM3's NoPE layers, Gemma 2's scale of head_dim)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.family_models import BUILDERS as FAMILY_BUILDERS
from tests.family_models import VOCAB, _model
from tests.gguf_writer import write_gguf
from tests.hf_oracle import hf_greedy
from tests.test_families import MAX_NEW_TOKENS, check, greedy_with_logprobs

SIX = dict(num_hidden_layers=6)
BUILDERS: dict[str, tuple[str, Any]] = {
    "llama": ("llama", lambda: _model("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)),
    "qwen2": ("qwen2", lambda: _model("Qwen2Config", "Qwen2ForCausalLM")),
    "qwen3": ("qwen3", lambda: _model("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)),
    "gemma": ("gemma", lambda: _model("GemmaConfig", "GemmaForCausalLM", head_dim=24)),
    "gemma2": ("gemma2", lambda: _model(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "gemma3": ("gemma3", lambda: _model(
        "Gemma3TextConfig", "Gemma3ForCausalLM", **SIX, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("phi3", lambda: _model("Phi3Config", "Phi3ForCausalLM", partial_rotary_factor=0.5, sliding_window=8)),
    "granite": ("granite", lambda: _model(
        "GraniteConfig", "GraniteForCausalLM", embedding_multiplier=3.0, residual_multiplier=0.7,
        attention_multiplier=0.2, logits_scaling=2.5, attention_bias=True)),
    "olmo2": ("olmo2", lambda: _model("Olmo2Config", "Olmo2ForCausalLM")),
    "smollm3": ("smollm3", lambda: _model("SmolLM3Config", "SmolLM3ForCausalLM", num_hidden_layers=4)),
    "glm4": ("glm4", lambda: _model("Glm4Config", "Glm4ForCausalLM", head_dim=16)),
    "command-r": ("command-r", lambda: _model("CohereConfig", "CohereForCausalLM", use_qk_norm=True, logit_scale=0.5)),
    "starcoder2": ("starcoder2", lambda: _model("Starcoder2Config", "Starcoder2ForCausalLM")),
    "gptneox": ("gptneox", lambda: _model("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, num_key_value_heads=4)),
    "stablelm": ("stablelm", lambda: _model(
        "StableLmConfig", "StableLmForCausalLM", use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True)),
    # mixtures of experts: Mixtral is llama.cpp's llama with experts; qwen2moe with its shared expert and a
    # dense layer (decoder_sparse_step 2)
    "mixtral": ("llama", lambda: _model("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)),
    "qwen2moe": ("qwen2moe", lambda: _model(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2)),
    "qwen3moe": ("qwen3moe", lambda: _model(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True)),
    # latent attention: V2 (softmax, groups by their best) with kv_b_proj whole as older files hold it, V3
    # (sigmoid plus exp_probs_b, a compressed q, YaRN's mscale_all_dim) split as today's converter writes it
    "deepseek_v2": ("deepseek2", lambda: FAMILY_BUILDERS["deepseek_v2"]()),
    "deepseek_v3": ("deepseek2", lambda: FAMILY_BUILDERS["deepseek_v3"]()),
    # sinks, biases everywhere, windows on the even layers, YaRN untruncated; SwiGLU's alpha and limit are
    # llama.cpp's constants (transformers' defaults), which the file does not hold
    "gpt_oss": ("gpt-oss", lambda: _model(
        "GptOssConfig", "GptOssForCausalLM", num_local_experts=8, num_experts_per_tok=2, head_dim=16,
        sliding_window=8, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 1.5e5})),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_gguf_file_is_the_checkpoint_it_came_from(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    arch, build = BUILDERS[name]
    torch.manual_seed(1)
    model = build()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param_name.endswith("weight"):
                param.normal_(0.0 if param.abs().max() == 0 else 1.0, 0.3)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.3)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(str(folder), arch, path, split_kv_b=name != "deepseek_v2")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 30)]
    tokens, logprobs, _ = greedy_with_logprobs(path, prompts, max_num_batched_tokens=16)
    for ours, values, prompt in zip(tokens, logprobs, prompts, strict=True):
        check(ours, values, hf_greedy(hf, prompt, MAX_NEW_TOKENS, None))
