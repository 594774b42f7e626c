"""Tiny random checkpoints of every decoder family, built with transformers (the oracle): each family's
quirks turned on and small enough to show (a window of 8 tokens, soft-caps near the scores' size, norms
and biases drawn away from their neutral values)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# The KV pool of an in-process engine on a tiny checkpoint, in tokens (num_kv_blocks = this // block_size):
# room for every test's prompts at once. The default 1 GiB would be ~130,000 blocks of a tiny model, each a
# Python object that check_invariants() walks after every step (most of such a test's time, 7x the rest).
TINY_KV_TOKENS = 4096


def _llama(**extra: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **extra}))


def _model(config_class: str, model_class: str, **extra: Any) -> Any:
    import transformers

    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    return getattr(transformers, model_class)(config)


def _gemma3_vlm() -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        **COMMON,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 20,
        "layer_types": SLIDING,
    }
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1
    )
    return Gemma3ForConditionalGeneration(config)


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama_rope_linear": lambda: _llama(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e4}
    ),
    "llama_rope_llama3": lambda: _llama(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 5e5,
        }
    ),  # fmt: skip
    "llama_rope_yarn": lambda: _llama(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 1e4,
        }
    ),
    "llama_rope_dynamic": lambda: _llama(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    ),
    "llama_bias": lambda: _llama(attention_bias=True, mlp_bias=True),
    "mistral_window": lambda: _model("MistralConfig", "MistralForCausalLM", sliding_window=8, head_dim=16),
    "qwen2_window": lambda: _model(
        "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "gemma": lambda: _model("GemmaConfig", "GemmaForCausalLM", head_dim=24, hidden_act="gelu"),
    "gemma2": lambda: _model(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0,
    ),  # fmt: skip
    "gemma3": lambda: _model(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=20,
        final_logit_softcapping=10.0,
        layer_types=SLIDING,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),  # fmt: skip
    "gemma3_vlm": _gemma3_vlm,
    "phi3": lambda: _model(
        "Phi3Config",
        "Phi3ForCausalLM",
        partial_rotary_factor=0.5,
        sliding_window=8,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0, 1.5, 2.0, 4.0],
            "long_factor": [2.0, 3.0, 4.0, 8.0],
        },
    ),  # fmt: skip
    # LongRoPE past its switch (24 tokens): prompts past it from the start, and one that crosses it
    "phi3_longrope": lambda: _model(
        "Phi3Config",
        "Phi3ForCausalLM",
        original_max_position_embeddings=24,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0, 1.5, 2.0, 4.0, 1.0, 1.0, 2.0, 3.0],
            "long_factor": [2.0, 3.0, 4.0, 8.0, 3.0, 5.0, 9.0, 16.0],
        },
    ),  # fmt: skip
    "granite": lambda: _model(
        "GraniteConfig",
        "GraniteForCausalLM",
        embedding_multiplier=3.0,
        residual_multiplier=0.7,
        attention_multiplier=0.2,
        logits_scaling=2.5,
        attention_bias=True,
        mlp_bias=True,
    ),  # fmt: skip
    "olmo2": lambda: _model("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": lambda: _model("Olmo3Config", "Olmo3ForCausalLM", sliding_window=8, layer_types=SLIDING),
    "smollm3": lambda: _model("SmolLM3Config", "SmolLM3ForCausalLM", no_rope_layers=[1, 0, 1]),
    "glm": lambda: _model("GlmConfig", "GlmForCausalLM", head_dim=16),
    "glm4": lambda: _model("Glm4Config", "Glm4ForCausalLM", head_dim=16),
    "cohere": lambda: _model("CohereConfig", "CohereForCausalLM", use_qk_norm=True, logit_scale=0.5),
    "starcoder2": lambda: _model("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=8),
    "gpt_neox": lambda: _model(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, num_key_value_heads=4, hidden_act="gelu"
    ),
    "gpt_neox_sequential": lambda: _model(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", use_parallel_residual=False, num_key_value_heads=4
    ),
    "stablelm": lambda: _model(
        "StableLmConfig",
        "StableLmForCausalLM",
        use_qkv_bias=True,
        qk_layernorm=True,
        use_parallel_residual=True,
    ),
    "stablelm_sequential": lambda: _model("StableLmConfig", "StableLmForCausalLM"),
    "stablelm_parallel": lambda: _model(
        "StableLmConfig", "StableLmForCausalLM", use_qkv_bias=True, use_parallel_residual=True
    ),
    "mixtral": lambda: _model(
        "MixtralConfig", "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=8
    ),
    "qwen2_moe": lambda: _model(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    ),  # fmt: skip
    "qwen3_moe": lambda: _model(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),  # fmt: skip
    "gpt_oss": lambda: _model(
        "GptOssConfig",
        "GptOssForCausalLM",
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        swiglu_limit=1.2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
            "rope_theta": 1.5e5,
        },
    ),  # fmt: skip
    # multi-head latent attention and grouped routing; V3 with a compressed q, YaRN with mscale_all_dim
    "deepseek_v2": lambda: _model(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_key_value_heads=4,
    ),  # fmt: skip
    "deepseek_v3": lambda: _model(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=24,
        q_lora_rank=20,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_key_value_heads=4,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "rope_theta": 1e4,
        },
    ),  # fmt: skip
}


def build_family(name: str, folder: str, seed: int = 0) -> None:
    """A tiny random checkpoint of `name` (a BUILDERS key) saved in `folder`; its norms' weights, biases
    and other neutral parameters drawn around their usual values, so that a missing one would show."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "vision" in param_name or "multi_modal" in param_name:
                continue
            if "norm" in param_name and param_name.endswith("weight"):
                # Gemma's norms hold an offset from 1 (zeros at init): either way, away from neutral
                param.normal_(0.0 if param.abs().max() == 0 else 1.0, 0.3)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
