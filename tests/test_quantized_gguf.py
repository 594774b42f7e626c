"""GGUF files served as their blocks (--quantization gguf, the default for a GGUF file) through the LLM API:
in float32 every token and logprob equals the dequantized model's (--quantization none), because each
packed product is linear_rows' FMA chain on the very float32 values the dequantization makes
(tests/test_kernels_quant.py); the weights held are the file's size; a flag that contradicts the checkpoint,
and a type that is not served packed, are start errors naming them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_core.engine_core import EngineCore
from frontend.offline.llm import LLM
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.gguf_writer import write_gguf
from worker.executor import InprocExecutor
from worker.model_config import UnsupportedModelError
from worker.models.experts import Experts
from worker.models.layers import Embedding, Linear
from worker.quant.gguf_pack import Q
from worker.quant.method import resolve_quantization

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)


def generate(model: str, quantization: str) -> list:  # type: ignore[type-arg]
    with LLM(model, dtype="float32", max_model_len=512, num_kv_blocks=64, quantization=quantization) as llm:
        return llm.generate(PROMPTS, GREEDY)


def test_packed_smollm2_equals_its_dequantized_self_in_float32(smollm2_gguf: str) -> None:
    packed, dense = generate(smollm2_gguf, "gguf"), generate(smollm2_gguf, "none")
    for ours, theirs in zip(packed, dense, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for mine, other in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in mine.items()} == {t: p.logprob for t, p in other.items()}


def test_the_weights_held_are_the_files_size(smollm2_gguf: str) -> None:
    """Every product and the embedding keep the file's blocks; what else the model holds is its norms."""
    worker = WorkerConfig(model=smollm2_gguf, dtype="bfloat16", num_kv_blocks=16, max_model_len=256)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    try:
        model = core.executor.runner.model  # type: ignore[attr-defined]
        held = {id(t): t.numel() * t.element_size() for t in model.state_dict().values()}
        quantized = [m for m in model.modules() if isinstance(m, (Linear, Embedding)) and m.quant is not None]
        assert len(quantized) == 1 + 30 * 4 + 1  # the embedding, 4 products a layer, the tied lm_head
        for module in quantized:
            parts = module.quant if isinstance(module, Linear) else [module.quant]
            held.update({part.packed.data_ptr(): part.nbytes for part in parts})
        assert model.native_layers is not None  # the csrc stack serves the packed products
        assert sum(held.values()) <= 1.02 * os.path.getsize(smollm2_gguf)
    finally:
        core.shutdown()


def test_a_flag_that_contradicts_the_checkpoint_is_refused(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert resolve_quantization(None, smollm2_gguf) == "gguf"
    assert resolve_quantization("none", smollm2_gguf) is None
    for method in ("awq", "gptq", "compressed-tensors"):
        with pytest.raises(
            UnsupportedModelError, match=f"--quantization {method}: .* is not quantized|quantized with gguf"
        ):
            resolve_quantization(method, smollm2_gguf)
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    assert resolve_quantization(None, str(tmp_path)) == "awq"
    with pytest.raises(UnsupportedModelError, match="--quantization gguf: .* quantized with awq"):
        resolve_quantization("gguf", str(tmp_path))


def tiny_gguf(tmp_path, name: str, quantize) -> str:  # type: ignore[no-untyped-def]
    """A tiny random checkpoint of a family written as a GGUF file whose products quantize() chooses."""
    from tests.test_gguf_families import BUILDERS

    arch, build = BUILDERS[name]
    torch.manual_seed(1)
    model = build()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.normal_(0.0 if param.abs().max() == 0 else 1.0, 0.3)
    folder = tmp_path / name
    model.save_pretrained(folder)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(str(folder), arch, path, quantize)
    return path


def mixed_types(name: str, data: np.ndarray):  # type: ignore[no-untyped-def]
    """Every 2-d weight quantized, each tensor a type by its name: a fused product's parts differ in type."""
    if data.ndim != 2 or data.shape[1] % 32 or data.shape[0] % 16:
        return None
    return TYPES[sum(name.encode()) % len(TYPES)]


TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# the families whose GGUF tensors move on the way in: llama's permuted q/k rows, GPT-NeoX's regrouped fused
# q/k/v, Phi-3's fused gate/up, Qwen2's biases, Gemma 3's tied embedding and windows
FAMILIES = ("llama", "gptneox", "phi3", "qwen2", "gemma3")


def tokens_and_logprobs(
    path: str,
    quantization: str,
    dtype: str = "float32",
    expert_loop: bool = False,
    activation_quantization: str | None = None,
) -> dict[str, tuple[list[int], list]]:  # type: ignore[type-arg]
    """Two prompts decoded together in 16-token steps: each one's tokens and its logprob rows. expert_loop:
    packed experts take Experts.packed_experts (Python) where csrc expert_loop would run them, and
    the model the Python layers."""
    worker = WorkerConfig(
        model=path, dtype=dtype, block_size=16, max_model_len=128, quantization=quantization,
        activation_quantization=activation_quantization,
    )  # fmt: skip
    core = EngineCore(EngineConfig(worker=worker, max_num_batched_tokens=16), InprocExecutor(worker))
    if expert_loop:
        core.executor.runner.model.native_layers = None  # type: ignore[attr-defined]
        for module in core.executor.runner.model.modules():  # type: ignore[attr-defined]
            if isinstance(module, Experts):
                module.quant_table = None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results: dict[str, tuple[list[int], list]] = {"0": ([], []), "1": ([], [])}  # type: ignore[type-arg]
    try:
        model = core.executor.runner.model  # type: ignore[attr-defined]
        # (a router or a shared expert's gate has fewer than 16 rows, qwen2moe's shared expert 48 inputs: float)
        products = [m for m in model.layers.modules()
                    if isinstance(m, Linear) and m.out_features % 16 == 0 and m.in_features % 32 == 0]  # fmt: skip
        assert all((m.quant is not None) == (quantization == "gguf") for m in products), (
            "a product not packed"
        )
        experts = [m for m in model.layers.modules() if isinstance(m, Experts)]
        assert all((m.quantized is not None) == (quantization == "gguf") for m in experts), (
            "experts not packed"
        )
        for i, n in enumerate((5, 23)):
            prompt = [(7 * j + 3 * i) % 500 for j in range(n)]
            core.add_request(
                AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=i)
            )
        while core.has_unfinished_requests():
            for _, output in core.step():
                results[output.request_id][0].extend(output.new_token_ids)
                if output.new_logprobs is not None:
                    results[output.request_id][1].append(output.new_logprobs)
    finally:
        core.shutdown()
    return results


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_packed_equals_its_dequantized_self(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(tmp_path, name, mixed_types)
    assert tokens_and_logprobs(path, "gguf") == tokens_and_logprobs(path, "none")


def experts_too(name: str, data: np.ndarray):  # type: ignore[no-untyped-def]
    """mixed_types, and each layer's stacked experts [experts, out, in] (gate, up and down apart) too."""
    if data.ndim == 3 and data.shape[2] % 32 == 0 and data.shape[1] % 16 == 0:
        return TYPES[sum(name.encode()) % len(TYPES)]
    return mixed_types(name, data)


def assert_packed_equals_dequantized(path: str) -> None:
    """The same tokens packed and dequantized, and logprobs to float32 rounding (the weighted sum of the
    experts rounds each term where fused_experts fuses it)."""
    packed, dense = tokens_and_logprobs(path, "gguf"), tokens_and_logprobs(path, "none")
    for key in packed:
        assert packed[key][0] == dense[key][0]
        for mine, theirs in zip(packed[key][1], dense[key][1], strict=True):
            assert mine.token_ids == theirs.token_ids
            torch.testing.assert_close(
                torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "qwen3moe", "deepseek_v3"])
def test_experts_kept_packed_equal_their_dequantized_selves(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each expert's gate, up and down products keep their blocks (Experts.packed_experts): in float32 the
    tokens of the same file dequantized, batched with chunked prefill, and its logprobs to float32 rounding
    (the products are the same bits; the weighted sum of the experts rounds each term where fused_experts
    fuses it)."""
    path = tiny_gguf(tmp_path, name, experts_too)
    assert_packed_equals_dequantized(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "deepseek_v3", "gpt_oss"])
def test_expert_loop_gives_the_python_loops_bits(name: str, dtype: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """csrc expert_loop (every packed expert of a layer in one C++ call), on the csrc decoder stack,
    against its reference, the Python loop Experts.packed_experts on the Python layers: the same tokens and
    logprobs, bit for bit, with Qwen2-MoE's gated shared expert, DeepSeek's shared experts, grouped routing
    and latent attention, and gpt-oss's clamped SwiGLU, biases, sinks and MXFP4 blocks."""
    types = (lambda n, d: Q.MXFP4 if d.ndim == 3 else mixed_types(n, d)) if name == "gpt_oss" else experts_too
    path = tiny_gguf(tmp_path, name, types)
    worker = WorkerConfig(model=path, dtype=dtype, block_size=16, max_model_len=128, quantization="gguf")
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    experts = [m for m in core.executor.runner.model.modules() if isinstance(m, Experts)]  # type: ignore[attr-defined]
    assert experts and all(m.quant_table is not None for m in experts)
    assert core.executor.runner.model.native_layers is not None  # type: ignore[attr-defined]
    core.shutdown()
    assert tokens_and_logprobs(path, "gguf", dtype) == tokens_and_logprobs(
        path, "gguf", dtype, expert_loop=True
    )


def test_gpt_oss_mxfp4_experts_kept_packed_equal_their_dequantized_selves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss's GGUF experts in MXFP4 (llama.cpp's 17-byte blocks): kept as each expert's MXFP4 blocks
    (its nibbles put back in the checkpoints' order), the same tokens as the file dequantized by the gguf
    package, and logprobs to float32 rounding."""
    path = tiny_gguf(
        tmp_path, "gpt_oss", lambda name, data: Q.MXFP4 if data.ndim == 3 else mixed_types(name, data)
    )
    assert_packed_equals_dequantized(path)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_the_2_and_3_bit_k_quants_are_served_packed(tmp_path, qtype) -> None:  # type: ignore[no-untyped-def]
    """A Q2_K or Q3_K file's products (here the MLP's gate and up, 256 dims in) kept packed: Q2_K in its own
    tiles (its 2-bit values as nibbles), Q3_K as Q6_K tiles of the same values. The tokens and logprobs of the
    file dequantized by the gguf package, exactly."""
    from tests.family_models import _model
    from tests.test_kernels_quant import random_blocks

    torch.manual_seed(1)
    folder = tmp_path / "llama"
    _model("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False, hidden_size=256).save_pretrained(
        folder
    )
    path = str(tmp_path / f"{qtype.name}.gguf")

    def k_quant(name: str, data: np.ndarray):  # type: ignore[no-untyped-def]
        if ".ffn_" in name and data.ndim == 2 and data.shape[1] % 256 == 0:
            return qtype, random_blocks(qtype, *data.shape, seed=sum(name.encode()))
        return mixed_types(name, data)

    write_gguf(str(folder), "llama", path, k_quant)
    assert tokens_and_logprobs(path, "gguf") == tokens_and_logprobs(path, "none")  # (every product packed)


def test_a_type_not_served_packed_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A GGUF file holding an IQ4_NL tensor: a start error naming the type and the tensor; `none` serves it."""
    path = tiny_gguf(
        tmp_path, "llama", lambda name, data: Q.IQ4_NL if name == "blk.0.ffn_down.weight" else None
    )
    with pytest.raises(
        UnsupportedModelError, match="'blk.0.ffn_down.weight' is IQ4_NL, which is not served packed"
    ):
        tokens_and_logprobs(path, "gguf")
    assert len(tokens_and_logprobs(path, "none")["1"][0]) == 12
