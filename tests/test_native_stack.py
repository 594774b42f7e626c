"""The csrc decoder stack (csrc/decoder_cpu.cpp) on every family it serves: the same tokens as the Python
layers, bit for bit, in float32 and bf16, with every step in one native call; and which families it serves
(worker/models/native.py), so that a family leaving it is a decision this test names."""

from __future__ import annotations

import random

import pytest

from tests.family_models import BUILDERS, VOCAB, build_family
from tests.test_correctness_tiny import MAX_NEW_TOKENS, greedy_tokens
from worker.config_files import load_model_config
from worker.csrc_ops import load_cpu_ops
from worker.models.native import native_stack_serves

NATIVE = [
    "llama_rope_linear", "llama_rope_llama3", "llama_rope_yarn", "llama_rope_dynamic", "llama_bias",
    "mistral_window", "qwen2_window", "gemma", "gemma2", "gemma3", "gemma3_vlm", "phi3", "phi3_longrope",
    "granite", "olmo2", "olmo3", "smollm3", "glm", "glm4", "cohere", "starcoder2", "gpt_neox",
    "gpt_neox_sequential", "stablelm", "stablelm_sequential", "stablelm_parallel", "mixtral", "qwen2_moe",
    "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
]  # fmt: skip


def test_the_families_the_stack_serves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    served = []
    for name in BUILDERS:
        folder = tmp_path / name
        build_family(name, str(folder))
        if native_stack_serves(load_model_config(str(folder))):
            served.append(name)
    assert served == NATIVE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "name",
    [
        "gemma",
        "gemma2",
        "gemma3",
        "granite",
        "olmo2",
        "olmo3",
        "smollm3",
        "phi3",
        "phi3_longrope",
        "glm",
        "glm4",
        "llama_bias",
        "starcoder2",
        "gpt_neox",
        "gpt_neox_sequential",
        "stablelm_parallel",
        "stablelm",
        "cohere",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_oss",
        "deepseek_v2",
        "deepseek_v3",
    ],  # fmt: skip
)
def test_the_stack_equals_the_python_layers_on_each_family(tmp_path, name: str, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Windows (8 keys, in their own pool where the family mixes them with full layers), soft-caps, Gemma's
    norms and GELU, post-norms, q/k norms over the projection, NoPE layers, the residual multiplier, partial
    and interleaved rotary, LongRoPE, biases, LayerNorms (Command R's too), per-head q/k norm weights, the
    parallel layouts and plain MLPs; mixtures of
    experts (routing, the fused experts, a gated shared expert, dense layers among sparse ones), attention
    sinks, and DeepSeek's latent attention (q direct or through q_a, the absorbed products, grouped routing)."""
    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build")
    build_family(name, str(tmp_path))
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (3, 9, 17, 30, 5, 12)]
    native, stack_calls, steps = greedy_tokens(str(tmp_path), prompts, dtype, native=True)
    python, python_calls, _ = greedy_tokens(str(tmp_path), prompts, dtype, native=False)
    assert native == python
    assert stack_calls == steps > MAX_NEW_TOKENS and python_calls == 0
