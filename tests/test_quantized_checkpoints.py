"""AWQ, GPTQ and compressed-tensors checkpoints (tiny random Llamas quantized in the tests,
tests/quant_writers.py) served as their integers (csrc/quant_cpu.cpp's integer types): in float32 greedy
tokens and logprobs equal HF transformers running the dequantized float32 model, alone, batched with chunked
prefill and with prefix caching; W8A8 quantizes each product's activations per token as vLLM does; a field
of quantization_config that is not served is a start error naming it."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from tests.family_models import TINY_KV_TOKENS
from tests.hf_oracle import OracleRun, compare_greedy, hf_greedy
from tests.quant_writers import tiny_llama, write
from tests.test_families import LOGPROB_TOLERANCE, greedy_with_logprobs
from worker.model_config import UnsupportedModelError
from worker.quant.method import resolve_quantization

MAX_NEW_TOKENS = 12
CHECKPOINTS = {
    "awq-g128": ("awq", {"group": 128}),
    "gptq-g32-sym": ("gptq", {"group": 32, "symmetric": True}),
    "gptq-v2-8bit-g64": ("gptq", {"bits": 8, "group": 64, "v2": True}),
    "ct-w4a16-g64": ("ct-pack", {"group": 64, "symmetric": True}),
    "ct-w4a16-channel-asym": ("ct-pack", {"group": -1, "symmetric": False}),
    "ct-w8a8": ("ct-int8", {"bits": 8, "group": -1}),
}


# W8A8: an activation within float32 rounding of the midpoint of two int8 steps lands on either (HF's and our
# float32 sums round differently, and attention's sums differ with chunking), which moves that product's output
# by a step times a weight, and this tiny random model's large weights carry it to the logits (up to 0.1 seen):
# its greedy tokens may part at a top-two gap below 0.1, and its logprobs agree to 0.2 (the product itself is
# exact: test_w8a8_products_quantize_each_rows_activations_to_int8)
W8A8 = (0.2, 0.1)
EXACT = (LOGPROB_TOLERANCE, 1e-4)


def check(
    ours: list[int], logprobs: list[float], oracle: OracleRun, tolerances: tuple[float, float] = EXACT
) -> None:
    agreed = compare_greedy(ours, oracle, tie_tolerance=tolerances[1]).num_matching
    expected = [float(oracle.logprobs[i][token]) for i, token in enumerate(ours[:agreed])]
    torch.testing.assert_close(
        torch.tensor(logprobs[:agreed]), torch.tensor(expected), atol=tolerances[0], rtol=0
    )


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    method, options = CHECKPOINTS[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    oracle_model = write(tiny_llama(), folder, method, **options)
    rng = random.Random(5)
    shared = [rng.randrange(511) for _ in range(32)]
    prompts = [[rng.randrange(511) for _ in range(n)] for n in (3, 17, 40)]
    prompts += [shared + [1, 2, 3], shared + [4, 5, 6, 7]]
    oracle = [hf_greedy(oracle_model, p, MAX_NEW_TOKENS, None) for p in prompts]
    return folder, prompts, oracle, W8A8 if method == "ct-int8" else EXACT


def test_served_packed_equals_the_dequantized_model(checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle, tolerance = checkpoint
    tokens, logprobs, core = greedy_with_logprobs(folder, prompts, max_num_batched_tokens=16,
                                                  enable_prefix_caching=True)  # fmt: skip
    model = core.executor.runner.model  # type: ignore[attr-defined]
    quantized = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(quantized) == 2 * 4  # qkv, o, gate_up and down of each layer kept as their integers
    assert model.native_layers is not None  # the csrc decoder stack runs them (W8A8's int8 rows too)
    for ours, values, expected in zip(tokens, logprobs, oracle, strict=True):
        check(ours, values, expected, tolerance)
    alone, alone_logprobs, _ = greedy_with_logprobs(folder, prompts[2:3])
    check(alone[0], alone_logprobs[0], oracle[2], tolerance)


def test_quantization_none_dequantizes_a_weight_only_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    oracle_model = write(tiny_llama(), str(tmp_path), "gptq", group=32, symmetric=True)
    prompt = list(range(7, 30))
    expected = hf_greedy(oracle_model, prompt, MAX_NEW_TOKENS, None)
    tokens, logprobs, core = greedy_with_logprobs(str(tmp_path), [prompt])
    assert resolve_quantization("none", str(tmp_path)) is None
    check(tokens[0], logprobs[0], expected)


def edit_config(folder: str, **fields: object) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(fields)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    ("method", "fields", "named"),
    [
        ("gptq", {"bits": 3}, "bits: 3"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format"),
        ("awq", {"version": "gemv"}, "version"),
        ("awq", {"zero_point": False}, "zero_point"),
        ("ct-pack", {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ("ct-pack", {"format": "nvfp4-pack-quantized"}, "format"),
    ],
)
def test_a_quantization_config_field_not_served_is_refused_by_name(tmp_path, method, fields, named) -> None:  # type: ignore[no-untyped-def]
    write(tiny_llama(), str(tmp_path), method, group=32, symmetric=True)
    edit_config(str(tmp_path), **fields)
    with pytest.raises(UnsupportedModelError, match=named):
        resolve_quantization(None, str(tmp_path))


@pytest.mark.parametrize(
    ("method", "orders"), [("gptq", "input"), ("ct-pack", True)], ids=["gptq-shared", "ct-pack-own"]
)
def test_an_act_order_checkpoint_is_served_packed_as_hf_runs_it(tmp_path, method, orders, caplog) -> None:  # type: ignore[no-untyped-def]
    """GPTQ's desc_act / compressed-tensors' actorder "group": each group's input dims scattered (g_idx,
    weight_g_idx). Kept as its integers in group order, each product taking its inputs permuted to match
    (once, where its parts share an order as GPTQ's q, k and v do; else part by part), on the csrc decoder
    stack: the dequantized HF model's tokens and logprobs, batched with chunked prefill and prefix caching, a
    prompt alone the same bits, and the Python layers the same bits as the stack."""
    folder = str(tmp_path)
    oracle_model = write(
        tiny_llama(), folder, method, group=32, symmetric=method == "ct-pack", act_order=orders
    )
    rng = random.Random(9)
    prompts = [[rng.randrange(511) for _ in range(n)] for n in (5, 23)]
    with caplog.at_level("INFO", logger="engine.worker"):
        tokens, logprobs, core = greedy_with_logprobs(folder, prompts, max_num_batched_tokens=16,
                                                      enable_prefix_caching=True)  # fmt: skip
    assert "14 act-order products" in caplog.text  # q, k, v, o, gate, up and down of two layers
    model = core.executor.runner.model  # type: ignore[attr-defined]
    quantized = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(quantized) == 2 * 4 and all(m.ordered for m in quantized)
    assert sum(part.order is not None for m in quantized for part in m.quant) == 14
    shared = [m.shared_order is not None for m in quantized]
    assert shared == [True] * 8 if orders == "input" else shared == [False, True, False, True] * 2
    assert model.native_layers is not None
    for ours, values, prompt in zip(tokens, logprobs, prompts, strict=True):
        check(ours, values, hf_greedy(oracle_model, prompt, MAX_NEW_TOKENS, None))
    alone, alone_logprobs, _ = greedy_with_logprobs(folder, prompts[1:])
    assert (alone[0], alone_logprobs[0]) == (tokens[1], logprobs[1])
    python, python_logprobs, _ = greedy_with_logprobs(folder, prompts, max_num_batched_tokens=16, native=False,
                                                      enable_prefix_caching=True)  # fmt: skip
    assert (python, python_logprobs) == (tokens, logprobs)


def test_w8a8_refuses_quantization_none_and_a_contradicting_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write(tiny_llama(), str(tmp_path), "ct-int8", bits=8, group=-1)
    assert resolve_quantization(None, str(tmp_path)) == "compressed-tensors"
    with pytest.raises(UnsupportedModelError, match="activations too"):
        resolve_quantization("none", str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="--quantization awq: .* compressed-tensors"):
        resolve_quantization("awq", str(tmp_path))


def test_the_products_hold_the_checkpoints_integers_not_floats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The weights held for the products: 4.5 bits a weight at groups of 128 (scales and offsets in float32),
    against 32 for the dequantized float32 model."""
    write(tiny_llama(), str(tmp_path), "awq", group=128)
    _, _, core = greedy_with_logprobs(str(tmp_path), [[1, 2, 3]])
    model = core.executor.runner.model  # type: ignore[attr-defined]
    quantized = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    weights = sum(m.in_features * m.out_features for m in quantized)
    held = sum(m.quant_nbytes for m in quantized)
    assert held * 8 / weights == pytest.approx(4.5)
    assert all(m.weight.numel() == 0 for m in quantized)


def test_w8a8_products_quantize_each_rows_activations_to_int8(ops) -> None:  # type: ignore[no-untyped-def]
    """A W8A8 product: each row's int8 values as torch computes them (scale max |x| / 127, round half to even
    of x / scale), their exact integer sums with the int8 weights, times the two scales (one rounding of each
    step: within float32 rounding of float64), the same bits alone and in a batch (on an AMX CPU passes of
    4 rows or more take tdpbusd tiles, fewer vpdpbusd: 40 rows are passes of 16, 16 and 8); bf16 rows too."""
    from worker.models.layers import Linear
    from worker.quant.blocks import IntBlocks, QuantPart

    torch.manual_seed(0)
    weights = torch.randint(-128, 128, (64, 256), dtype=torch.int8)
    w_scale = torch.rand(64, 1) * 0.01
    blocks = IntBlocks(8, weights.numpy(), w_scale.numpy(), torch.zeros(64, 1).numpy(), "int8-token")
    bias = torch.randn(64)
    linear = Linear(256, 64, bias=True)
    linear.bias.data = bias
    linear.add_quant(QuantPart(0, blocks.qtype, blocks.packed(), 64, blocks.activations))
    linear.finalize_quant(ops)
    x = torch.randn(40, 256) * torch.linspace(0.1, 3, 256)
    x[3] = 0.0
    x[5, 7] = 1000.0  # one large value: the rest of the row rounds to few steps
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1), 0).round().clamp(-128, 127)
    exact = (q.double() @ weights.double().T) * (scale.double() * w_scale.double().T) + bias.double()
    y = linear(x)
    torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[3], bias)
    for i in (0, 5, 18, 33, 39):
        assert torch.equal(linear(x[i : i + 1]), y[i : i + 1]), f"row {i} alone differs from the batch"
        assert torch.equal(linear(x[i : i + 3]), y[i : i + 3]), f"rows {i}.. in a pass of 3 differ"
    rows = x.bfloat16()
    assert torch.equal(linear(rows), linear(rows.float()).bfloat16())  # the output rounded once, to bf16


@pytest.mark.slow
def test_engine_serve_answers_from_a_gptq_checkpoint_as_the_dequantized_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`engine serve` on the folder, the openai SDK's completions with a token-id prompt (the tiny model has
    no tokenizer): HF's greedy tokens on the dequantized model, and the logprobs to float32 rounding."""
    import openai

    from tests.serve_helpers import serving

    oracle_model = write(tiny_llama(), str(tmp_path), "gptq", bits=4, group=128)
    prompt = [5, 80, 33, 101, 7, 250, 9, 14]
    expected = hf_greedy(oracle_model, prompt, MAX_NEW_TOKENS, None)
    flags = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "32"]
    with serving(str(tmp_path), *flags) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
        done = client.completions.create(model=str(tmp_path), prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                         temperature=0.0, logprobs=1, extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    tokens = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
    check(tokens, [float(p) for p in logprobs.token_logprobs], expected)


def test_lora_on_an_awq_base_equals_peft_on_the_dequantized_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An adapter on every product of a quantized base: the low-rank products in float32 on top of the
    integer products; our tokens and logprobs equal peft's on the dequantized model."""
    from engine_core.engine_core import EngineCore
    from protocol.config import EngineConfig, WorkerConfig
    from protocol.lora import LoraAdapter, LoraConfig
    from protocol.messages import AddRequest
    from protocol.sampling import SamplingParams
    from tests.lora_helpers import make_adapter, peft_model
    from worker.executor import InprocExecutor

    dequantized = write(tiny_llama(), str(tmp_path), "awq", group=64)
    dequantized.save_pretrained(tmp_path / "dequantized")  # the oracle's base: the float32 values served
    make_adapter(
        str(tmp_path / "dequantized"), str(tmp_path / "adapter"), 8, 16, "all-linear", seed=3, scale=0.3
    )
    worker = WorkerConfig(model=str(tmp_path), dtype="float32", block_size=16, max_model_len=128,
                          num_kv_blocks=TINY_KV_TOKENS // 16, lora=LoraConfig(max_loras=1, max_lora_rank=8))  # fmt: skip
    core = EngineCore(
        EngineConfig(worker=worker, lora_modules=[LoraAdapter(name="a", path=str(tmp_path / "adapter"))]),
        InprocExecutor(worker),
    )
    prompt = list(range(40, 70))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    core.add_request(AddRequest(request_id="0", prompt_token_ids=prompt, sampling_params=params, arrival_time=0,
                                lora_name="a"))  # fmt: skip
    tokens: list[int] = []
    logprobs: list[float] = []
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens.extend(output.new_token_ids)
            if output.new_logprobs is not None:
                logprobs.extend(row[0] for row in output.new_logprobs.logprobs)
    model = core.executor.runner.model  # type: ignore[attr-defined]
    assert sum(getattr(m, "quant", None) is not None for m in model.modules()) == 8
    adapted = peft_model(str(tmp_path / "dequantized"), str(tmp_path / "adapter"))
    check(tokens, logprobs, hf_greedy(adapted, prompt, MAX_NEW_TOKENS, None))
    assert tokens != hf_greedy(dequantized, prompt, MAX_NEW_TOKENS, None).token_ids, "the adapter matters"


def test_a_quantized_checkpoint_as_an_embedder_through_the_llm_api(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`LLM(..., convert="embed")` on a compressed-tensors W4A16 checkpoint: each input's normalized last
    hidden state equals the dequantized model's in HF."""
    import numpy as np

    from frontend import LLM
    from protocol.config import WorkerConfig
    from worker.model_runner import ModelRunner

    dequantized = write(tiny_llama(), str(tmp_path), "ct-pack", group=128, symmetric=True)
    prompts = [list(range(3, 8)), list(range(100, 133))]
    with LLM(str(tmp_path), convert="embed", dtype="float32", max_model_len=128) as llm:
        results = llm.embed([{"prompt_token_ids": p} for p in prompts])
    runner = ModelRunner(
        WorkerConfig(model=str(tmp_path), dtype="float32", max_model_len=128, convert="embed")
    )
    assert runner.pooling is not None
    assert sum(getattr(m, "quant", None) is not None for m in runner.model.modules()) == 8  # served packed
    for prompt, result in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = dequantized(torch.tensor([prompt]), output_hidden_states=True)
        expected = torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1).numpy()
        assert float(np.dot(result.outputs.embedding, expected)) >= 0.99999


def test_a_group_size_the_tensors_contradict_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from worker.config_files import load_model_config
    from worker.weights import iterate_weights

    write(tiny_llama(), str(tmp_path), "awq", group=128)
    edit_config(str(tmp_path), group_size=64)
    with pytest.raises(
        UnsupportedModelError, match="_proj: awq .* groups of 128 dims, the config's group_size is 64"
    ):
        list(iterate_weights(str(tmp_path), load_model_config(str(tmp_path)), progress=False, packed=True))


def test_act_order_experts_keep_their_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Qwen3-MoE GPTQ checkpoint as AutoGPTQ writes mixtures (each expert's gate_proj, up_proj and down_proj a
    quantized module of its own), in act-order, gate and up each in an order of its own: each expert keeps its
    integers and its parts' input orders (csrc expert_loop, on the csrc decoder stack): the tokens and
    logprobs of HF running the dequantized model, and the Python layers' bits."""
    from safetensors.torch import save_file

    from tests.family_models import BUILDERS
    from tests.quant_writers import dequantized, pack_words, quantize

    torch.manual_seed(0)
    model = BUILDERS["qwen3_moe"]().eval()
    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    rng = torch.Generator().manual_seed(4)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:  # (a dense layer)
            continue
        inter = experts.down_proj.shape[2]
        for e in range(experts.gate_up_proj.shape[0]):
            weights = {"gate_proj": experts.gate_up_proj[e, :inter], "up_proj": experts.gate_up_proj[e, inter:],
                       "down_proj": experts.down_proj[e]}  # fmt: skip
            for name, w in weights.items():
                k = w.shape[1]
                order = torch.randperm(k, generator=rng)
                q, scale, zero = quantize(w.detach()[:, order], 4, 32, True, torch.float16)
                where = torch.empty_like(order)
                where[order] = torch.arange(k)
                with torch.no_grad():
                    w.copy_(dequantized(q, scale, zero)[:, where])
                prefix = f"model.layers.{i}.mlp.experts.{e}.{name}"
                tensors[f"{prefix}.qweight"] = pack_words(q[:, where], 4).T.contiguous()
                tensors[f"{prefix}.qzeros"] = pack_words(zero.T - 1, 4)
                tensors[f"{prefix}.scales"] = scale.T.contiguous()
                tensors[f"{prefix}.g_idx"] = (where // 32).to(torch.int32)
        del (
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"],
            tensors[f"model.layers.{i}.mlp.experts.down_proj"],
        )
    folder = str(tmp_path)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    model.config.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [type(model).__name__]
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                     "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = [[random.Random(3).randrange(500) for _ in range(n)] for n in (6, 19)]
    tokens, logprobs, core = greedy_with_logprobs(folder, prompts, max_num_batched_tokens=16)
    packed = [m for m in core.executor.runner.model.modules() if getattr(m, "quantized", None) is not None]  # type: ignore[attr-defined]
    assert packed, "the experts were not kept packed"
    assert all(m.quant_orders is not None for m in packed), "csrc expert_loop takes their orders"
    assert core.executor.runner.model.native_layers is not None  # type: ignore[attr-defined]
    for ours, values, prompt in zip(tokens, logprobs, prompts, strict=True):
        check(ours, values, hf_greedy(model, prompt, MAX_NEW_TOKENS, None))
    python = greedy_with_logprobs(folder, prompts, max_num_batched_tokens=16, native=False)
    assert python[:2] == (tokens, logprobs), "the Python layers' bits"
