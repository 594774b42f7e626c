"""LoRA on a mixture of experts' routed experts (worker/lora/experts.py, Experts.adapted): tokens and logprobs
equal peft's on HF transformers, for each MoE family (Qwen3-MoE with a dense layer, Qwen2-MoE with its shared
expert, Mixtral, gpt-oss with its transposed, interleaved experts), in a batch beside the base model's rows
(which equal HF's) and alone (the same bits: batch-invariant); the per-expert form PEFT wrote for
transformers 4 gives the stacked form's bits; what is not served is refused by name."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.lora import LoraAdapter, LoraConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS, VOCAB, build_family
from tests.hf_oracle import hf_greedy
from tests.lora_helpers import make_adapter, peft_model
from tests.test_correctness_tiny import _CountingOps
from tests.test_families import MAX_NEW_TOKENS, check
from worker.executor import InprocExecutor

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def serve(
    folder: str,
    adapters: dict[str, str],
    jobs: list[tuple[list[int], str | None]],
    backend: str = "auto",
    quantization: str | None = None,
    dtype: str = "float32",
    native: bool = True,
    counted: list[int] | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Each job's (greedy tokens, their logprobs), all jobs in one engine's batches (float32; backend torch:
    without the csrc kernels). native False: the Python layers, not the csrc decoder stack; counted: gets
    the stack's calls and the engine's steps."""
    worker = WorkerConfig(model=folder, dtype=dtype, block_size=16, max_model_len=128, attention_backend=backend,
                          num_kv_blocks=TINY_KV_TOKENS // 16, lora=LoraConfig(max_loras=2, max_lora_rank=8),
                          quantization=quantization)  # fmt: skip
    modules = [LoraAdapter(name=name, path=path) for name, path in adapters.items()]
    core = EngineCore(EngineConfig(worker=worker, lora_modules=modules), InprocExecutor(worker))
    model = core.executor.runner.model  # type: ignore[attr-defined]
    if not native:
        model.native_layers = None
    if model.ops is not None:
        model.ops = counting = _CountingOps(model.ops)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    for i, (prompt, lora) in enumerate(jobs):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i, lora_name=lora))  # fmt: skip
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in jobs]
    try:
        while core.has_unfinished_requests():
            for _, output in core.step():
                tokens, logprobs = results[int(output.request_id)]
                tokens.extend(output.new_token_ids)
                if output.new_logprobs is not None:
                    logprobs.extend(row[0] for row in output.new_logprobs.logprobs)
    finally:
        core.shutdown()
    if counted is not None:
        counted += [counting.stack_calls, core.num_steps]
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "qwen3moe-gguf"])
def test_expert_adapter_rows_run_on_the_stack_as_on_the_python_layers(
    name: str, dtype: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A step with rows whose adapter targets the experts stays on the csrc decoder stack (those rows take
    csrc expert_loop with their adapters, expert by expert; the others fused_experts, or expert_loop for
    experts kept as GGUF blocks): the Python layers' tokens and logprobs, bit for bit, every step native."""
    quantization = None
    if name.endswith("-gguf"):
        from tests.test_quantized_gguf import experts_too, tiny_gguf

        base, quantization = tiny_gguf(tmp_path, "qwen3moe", experts_too), "gguf"
        folder = str(tmp_path / "qwen3moe")
    else:
        base = folder = str(tmp_path / "base")
        build_family(name, base)
    adapter = make_adapter(folder, str(tmp_path / "experts"), 8, 16, ATTENTION, seed=3, scale=0.3,
                           parameters=EXPERTS)  # fmt: skip
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (12, 30)]
    jobs = [(p, lora) for p in prompts for lora in ("experts", None)]
    counted: list[int] = []
    stack = serve(base, {"experts": adapter}, jobs, quantization=quantization, dtype=dtype, counted=counted)
    python = serve(base, {"experts": adapter}, jobs, quantization=quantization, dtype=dtype, native=False)
    assert stack == python
    assert stack[0] != stack[1], "the adapter changes the output"
    assert counted[0] == counted[1] >= MAX_NEW_TOKENS, "every step on the stack"


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("qwen3_moe", "auto"),
        ("qwen2_moe", "auto"),
        ("mixtral", "auto"),
        ("gpt_oss", "auto"),
        ("qwen2_moe", "torch"),
    ],
    ids=["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "qwen2_moe-without-kernels"],
)
def test_an_adapter_on_the_experts_equals_peft(name: str, backend: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "base")
    build_family(name, base)
    adapter = make_adapter(
        base, str(tmp_path / "experts"), 8, 16, ATTENTION, seed=3, scale=0.3, parameters=EXPERTS
    )
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (12, 30)]
    jobs = [(p, lora) for p in prompts for lora in ("experts", None)]
    batched = serve(base, {"experts": adapter}, jobs, backend)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    adapted = peft_model(base, adapter)
    for (prompt, lora), (tokens, logprobs) in zip(jobs, batched, strict=True):
        check(tokens, logprobs, hf_greedy(adapted if lora else hf, prompt, MAX_NEW_TOKENS, None))
    assert batched[0] != batched[1], "the adapter changes the output"
    if backend == "torch":  # (batch-variant without the kernels)
        return
    alone = serve(base, {"experts": adapter}, [jobs[2]])
    assert alone[0] == batched[2], "an adapter row's bits depend on its batch"


def test_the_per_expert_form_gives_the_stacked_forms_bits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mixtral's adapter as transformers 4's per-expert Linears named it (block_sparse_moe.experts.<e>.w1/w3/w2,
    one A each) holds the same factors as PEFT's stacked form: the same tokens and logprobs, bit for bit."""
    import json

    base = str(tmp_path / "base")
    build_family("mixtral", base)
    stacked = make_adapter(base, str(tmp_path / "stacked"), 4, 8, [], seed=5, scale=0.3, parameters=EXPERTS)
    tensors = load_file(f"{stacked}/adapter_model.safetensors")
    experts, hidden = (
        8,
        tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape[1],
    )
    per_expert = {}
    for key, value in tensors.items():
        stem, _, half = key.rpartition(".lora_")
        layer = stem.split(".")[4]
        outer = not stem.endswith("base_layer")  # the outermost wrapper is down_proj's
        factor = value.view(experts, 4, -1) if half == "A.weight" else value.view(value.shape[0], 4, experts)
        for e in range(experts):
            one = factor[e] if half == "A.weight" else factor[:, :, e]
            prefix = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{e}"
            if outer:
                per_expert[f"{prefix}.w2.lora_{half}"] = one.contiguous()
            elif half == "A.weight":
                per_expert[f"{prefix}.w1.lora_{half}"] = per_expert[f"{prefix}.w3.lora_{half}"] = (
                    one.contiguous()
                )
            else:  # gate rows first, then up
                inter = one.shape[0] // 2
                per_expert[f"{prefix}.w1.lora_{half}"] = one[:inter].contiguous()
                per_expert[f"{prefix}.w3.lora_{half}"] = one[inter:].contiguous()
    modules = tmp_path / "modules"
    modules.mkdir()
    save_file({k: v.clone() for k, v in per_expert.items()}, str(modules / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "stacked" / "adapter_config.json").read_text())
    config.update(target_modules=["w1", "w2", "w3"], target_parameters=None)
    (modules / "adapter_config.json").write_text(json.dumps(config))
    assert hidden > 0
    prompt = [random.Random(4).randrange(VOCAB - 1) for _ in range(20)]
    a, b = serve(
        base, {"stacked": stacked, "modules": str(modules)}, [(prompt, "stacked"), (prompt, "modules")]
    )
    assert a == b


def test_an_adapter_on_experts_kept_packed_equals_it_on_the_file_dequantized(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Qwen3-MoE GGUF file whose experts keep their blocks (Experts.product on each expert's packed Linears):
    with an adapter on the experts, the tokens of the same file dequantized, and logprobs to float32
    rounding (the products are the same bits; fused_experts fuses the weighted sum's terms)."""
    from tests.test_quantized_gguf import experts_too, tiny_gguf

    path = tiny_gguf(tmp_path, "qwen3moe", experts_too)
    adapter = make_adapter(str(tmp_path / "qwen3moe"), str(tmp_path / "experts"), 4, 8, [], seed=6, scale=0.3,
                           parameters=EXPERTS)  # fmt: skip
    prompt = [random.Random(7).randrange(VOCAB - 1) for _ in range(20)]
    jobs = [(prompt, "experts"), (prompt, None)]
    packed = serve(path, {"experts": adapter}, jobs, quantization="gguf")
    dense = serve(path, {"experts": adapter}, jobs, quantization="none")
    assert packed[0] != packed[1], "the adapter changes the output"
    for (tokens, logprobs), (expected, expected_logprobs) in zip(packed, dense, strict=True):
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-5, rtol=0)


def test_what_an_adapter_may_not_target_on_a_mixture_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from protocol.errors import InvalidParameterError
    from protocol.lora import LoraRequest
    from worker.config_files import load_model_config
    from worker.lora.manager import LoraManager

    def manager(folder: str) -> LoraManager:
        return LoraManager(LoraConfig(max_loras=1, max_lora_rank=8), load_model_config(folder), torch.float32)

    moe, dense = str(tmp_path / "qwen3_moe"), str(tmp_path / "llama")
    build_family("qwen3_moe", moe)
    build_family("llama_bias", dense)
    router = make_adapter(
        moe, str(tmp_path / "router"), 4, 8, ["gate"]
    )  # (peft: target_parameters gate.weight)
    with pytest.raises(InvalidParameterError, match=r"target_parameters \['gate.weight'\] are not supported"):
        manager(moe).add(LoraRequest(lora_id=1, name="router", path=router))
    shared = str(tmp_path / "qwen2_moe")
    build_family("qwen2_moe", shared)
    shared_gate = make_adapter(shared, str(tmp_path / "shared"), 4, 8, ["shared_expert_gate"])
    with pytest.raises(
        InvalidParameterError, match=r"\['shared_expert_gate'\] are not supported.*its routed experts"
    ):
        manager(shared).add(LoraRequest(lora_id=1, name="shared", path=shared_gate))
    on_dense = make_adapter(dense, str(tmp_path / "dense"), 4, 8, ["q_proj"])
    config = (tmp_path / "dense" / "adapter_config.json").read_text()
    (tmp_path / "dense" / "adapter_config.json").write_text(
        config.replace('"target_parameters": null', '"target_parameters": ["mlp.experts.gate_up_proj"]')
    )
    with pytest.raises(InvalidParameterError, match="target_parameters .* a mixture-of-experts model's"):
        manager(dense).add(LoraRequest(lora_id=1, name="dense", path=on_dense))
    odd = make_adapter(moe, str(tmp_path / "odd"), 4, 8, [], parameters=["mlp.experts.gate_up_proj"])
    config = (tmp_path / "odd" / "adapter_config.json").read_text()
    (tmp_path / "odd" / "adapter_config.json").write_text(config.replace('"r": 4', '"r": 2'))
    with pytest.raises(
        InvalidParameterError, match=r"experts.gate_up_proj: lora_A \(32, 64\) .* do not fit 8 experts"
    ):
        manager(moe).add(LoraRequest(lora_id=1, name="odd", path=odd))
