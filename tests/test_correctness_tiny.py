"""Our greedy output equals HF transformers' token for token, on tiny random Llama, Qwen2 and Qwen3 models
(float32), with prefix caching on and off, 16-token chunks, a pool small enough to force preemption, and
async scheduling (each step scheduled while the one before it runs).

These run the EngineCore with the in-process executor (real scheduler, real worker code, no processes).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import COMMON, TINY_KV_TOKENS
from tests.hf_oracle import compare_greedy, hf_greedy
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 24


def build_tiny(family: str, folder: str, vocab_size: int = 512) -> None:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = {**COMMON, "vocab_size": vocab_size, "num_hidden_layers": 2, "tie_word_embeddings": False}
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6))
        with torch.no_grad():  # random non-zero biases, so a missing bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_theta=1e6))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1, 0.3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_model(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp(request.param))
    build_tiny(request.param, folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(7)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 70))] for _ in range(6)]
    prompts += [shared + [1, 2, 3], shared + [4, 5]]  # a shared 40-token prefix
    oracle = [hf_greedy(hf, p, MAX_NEW_TOKENS, None) for p in prompts]
    return folder, prompts, oracle


def run_engine(  # type: ignore[no-untyped-def]
    folder: str, prompts: list[list[int]], params: SamplingParams | None = None, **engine_kwargs
) -> tuple[list[list[int]], EngineCore]:
    """Greedy tokens of each prompt (params: MAX_NEW_TOKENS past EOS unless given), all queued at once in a
    float32 in-process engine; the invariants checked every step and every block free at the end."""
    worker_kwargs = {"block_size": 16, "num_kv_blocks": TINY_KV_TOKENS // 16}
    worker_keys = ("block_size", "num_kv_blocks", "max_model_len")
    worker_kwargs.update({k: engine_kwargs.pop(k) for k in worker_keys if k in engine_kwargs})
    worker = WorkerConfig(model=folder, dtype="float32", **worker_kwargs)
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=i)
        )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return [tokens[str(i)] for i in range(len(prompts))], core


CONFIGS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunk_16": dict(max_num_batched_tokens=16),
    "tiny_pool_preemption": dict(num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=64),
    "async_chunk_16": dict(async_scheduling=True, max_num_batched_tokens=16),
    "async_tiny_pool_preemption": dict(
        async_scheduling=True, num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=64
    ),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf(tiny_model, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny_model
    outputs, core = run_engine(folder, prompts, **dict(CONFIGS[config_name]))
    for ours, expected in zip(outputs, oracle, strict=True):
        compare_greedy(ours, expected)
    if config_name.endswith("tiny_pool_preemption"):
        assert core.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if config_name == "chunk_16":
        assert core.scheduler.config.max_num_batched_tokens == 16


@pytest.mark.parametrize("native", [True, False])
def test_the_last_layer_runs_on_the_scored_rows_only(tiny_model, native: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past the last layer's KV write only the rows a step scores are needed: the model returns those
    rows alone, in 16-token chunks most prefill steps score none, and the tokens still equal HF's."""
    from worker.csrc_ops import load_cpu_ops

    if native and load_cpu_ops() is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build")
    from worker.models.causal_lm import CausalLM

    steps: list[tuple[int, int | None, int]] = []  # (tokens, scored rows or None for all, rows returned)
    mlp_rows: list[int] = []
    forward, finalize = CausalLM.forward, CausalLM.finalize

    def recording_forward(self, input_ids, *args):  # type: ignore[no-untyped-def]
        hidden = forward(self, input_ids, *args)
        out_rows = args[4]  # (positions, kv_caches, metadata, backend, out_rows, lora)
        steps.append((len(input_ids), None if out_rows is None else len(out_rows), hidden.shape[0]))
        return hidden

    def finalize_and_hook(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        finalize(self, *args, **kwargs)
        if not native:
            self.native_layers = None
        self.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: mlp_rows.append(args[0].shape[0]))

    monkeypatch.setattr(CausalLM, "forward", recording_forward)
    monkeypatch.setattr(CausalLM, "finalize", finalize_and_hook)
    folder, prompts, oracle = tiny_model
    outputs, _ = run_engine(folder, prompts, max_num_batched_tokens=16)
    for ours, expected in zip(outputs, oracle, strict=True):
        compare_greedy(ours, expected)
    assert all(returned == (tokens if scored is None else scored) for tokens, scored, returned in steps)
    assert any(scored == 0 for _, scored, _ in steps), "a chunk that samples nothing scores no row"
    assert any(scored is not None and 0 < scored < tokens for tokens, scored, _ in steps)
    assert any(scored is None for _, scored, _ in steps), "a decode step scores every row"
    if not native:  # the Python layers: the last MLP saw the scored rows only
        assert mlp_rows == [returned for _, _, returned in steps if returned]


def test_shared_prefix_hits_cache_and_still_matches(tiny_model) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny_model
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, num_kv_blocks=TINY_KV_TOKENS // 16)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    cached = {}
    for index in (6, 7):  # one after the other: the second finds the first's prefix blocks
        core.add_request(
            AddRequest(
                request_id=str(index), prompt_token_ids=prompts[index], sampling_params=params, arrival_time=0
            )
        )
        tokens = []
        while core.has_unfinished_requests():
            for _, output in core.step():
                tokens.extend(output.new_token_ids)
                cached[index] = output.num_cached_tokens
        compare_greedy(tokens, oracle[index])
    assert cached[6] == 0 and cached[7] == 32  # two full 16-token blocks of the 40-token shared prefix


def sampled_tokens(folder: str, prompts: list[list[int]], async_scheduling: bool) -> dict[str, tuple]:
    """Seeded sampling with penalties, logprobs and stop tokens; chunks of 16 and late arrivals, so steps
    mix decode rows and prefill chunks and requests stop while the next step is already scheduled."""
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, num_kv_blocks=TINY_KV_TOKENS // 16)
    config = EngineConfig(worker=worker, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    core = EngineCore(config, InprocExecutor(worker))
    results: dict[str, tuple] = {}

    def step() -> None:
        for _, output in core.step():
            tokens, logprobs, _ = results.setdefault(output.request_id, ([], [], None))
            tokens.extend(output.new_token_ids)
            logprobs.extend(output.new_logprobs.logprobs if output.new_logprobs else [])
            if output.finish_reason:
                results[output.request_id] = (tokens, logprobs, output.finish_reason)

    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0.9,
            seed=100 + i,
            max_tokens=MAX_NEW_TOKENS,
            repetition_penalty=1.3 if i % 2 else 1.0,
            frequency_penalty=0.5 if i % 3 == 0 else 0.0,
            stop_token_ids=list(range(0, 512, 9)) if i % 2 else [],  # these stop early, each at its own step
            min_tokens=2,
            logprobs=2,
        )
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=i)
        )
        if i % 3 == 2:
            step()
    while core.has_unfinished_requests():
        step()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return results


def test_async_scheduling_samples_what_sync_does(tiny_model) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, _ = tiny_model
    sync = sampled_tokens(folder, prompts, async_scheduling=False)
    assert {reason for _, _, reason in sync.values()} == {"stop", "length"}
    pipelined = sampled_tokens(folder, prompts, async_scheduling=True)
    assert {k: (tokens, reason) for k, (tokens, _, reason) in pipelined.items()} == {
        k: (tokens, reason) for k, (tokens, _, reason) in sync.items()
    }
    for request_id, (_, logprobs, _) in pipelined.items():  # other batch shapes round other ways
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(sync[request_id][1]), rtol=0, atol=1e-4
        )


def prompt_logprobs(
    folder: str, prompts: list[list[int]], backend: str, batch_invariant: bool = False
) -> tuple[list[list[float]], EngineCore]:
    worker = WorkerConfig(
        model=folder,
        dtype="bfloat16",
        block_size=16,
        attention_backend=backend,
        batch_invariant=batch_invariant,
        num_kv_blocks=TINY_KV_TOKENS // 16,
    )
    # 16-token chunks: later chunks attend to their cached context; one token of output also decodes.
    core = EngineCore(EngineConfig(worker=worker, max_num_batched_tokens=16), InprocExecutor(worker))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=i)
        )
    values: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            if output.new_prompt_logprobs is not None:
                values[output.request_id].extend(row[0] for row in output.new_prompt_logprobs.logprobs)
    return [values[str(i)] for i in range(len(prompts))], core


def test_bf16_fast_path_matches_the_torch_reference(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """bf16 through the csrc kernels and packed weights (oneDNN's, and on CPUs with AVX-512 BF16 and no
    AMX the pair layout for few rows: these 16-token chunks take it), and through the batch-invariant
    kernels, vs the plain torch layers: same prompt logprobs up to bf16 rounding (the paths round the
    same steps; products sum in other orders)."""
    from worker.csrc_ops import load_cpu_ops
    from worker.models.layers import Linear, can_pack, use_pairs

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build")
    folder, prompts, _ = tiny_model
    reference, _ = prompt_logprobs(folder, prompts, "torch")
    fast, core = prompt_logprobs(folder, prompts, "cpu")
    runner = core.executor.runner  # type: ignore[attr-defined]
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    # oneDNN packs bf16 weights only where the CPU has bf16 products (AVX-512 BF16 or AMX); an AVX2-only
    # CPU keeps F.linear, and the comparison below holds all the same.
    packs = can_pack(torch.bfloat16)
    assert linears and all((m.packed is not None) == packs for m in linears), "bf16 packing as the CPU allows"
    assert all((m.pairs is not None) == use_pairs(load_cpu_ops()) for m in linears)
    invariant, core = prompt_logprobs(folder, prompts, "cpu", batch_invariant=True)
    linears = [m for m in core.executor.runner.model.modules() if isinstance(m, Linear)]  # type: ignore[attr-defined]
    assert all(m.rows is not None or m.pairs is not None for m in linears), "one kernel for every row count"
    for path in (fast, invariant):
        for ours, expected in zip(path, reference, strict=True):
            assert len(ours) == len(expected) > 0
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=0.15, rtol=0.05)


class _CountingOps:
    """The csrc module, counting calls of the one-call decoder stack."""

    def __init__(self, ops) -> None:  # type: ignore[no-untyped-def]
        self.ops, self.stack_calls = ops, 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "decoder_layers":
            self.stack_calls += 1
        return getattr(self.ops, name)


def greedy_tokens(
    folder: str, prompts: list[list[int]], dtype: str, native: bool
) -> tuple[list[list[int]], int, int]:
    """Greedy tokens with the decoder stack in one native call (or the Python layers); the late prompts
    arrive while the first ones decode, so steps mix decode rows and prefill chunks."""
    worker = WorkerConfig(model=folder, dtype=dtype, block_size=16, num_kv_blocks=TINY_KV_TOKENS // 16)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    model = core.executor.runner.model  # type: ignore[attr-defined]
    assert model.native_layers is not None, "the csrc build has the decoder stack"
    if not native:
        model.native_layers = None
    model.ops = counting = _CountingOps(model.ops)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    half = len(prompts) // 2
    for i in range(len(prompts)):
        if i == half:
            for _ in range(3):
                for _, output in core.step():
                    tokens[output.request_id].extend(output.new_token_ids)
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompts[i], sampling_params=params, arrival_time=i)
        )
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))], counting.stack_calls, core.num_steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decoder_stack_equals_the_python_layers(tiny_model, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """csrc/decoder_cpu.cpp runs the same kernels as the Python layers: the same tokens, bit for bit, and
    it serves every step of short prompts (decode, prefill, and the two mixed)."""
    from worker.csrc_ops import load_cpu_ops

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build")
    folder, prompts, _ = tiny_model
    native, stack_calls, steps = greedy_tokens(folder, prompts, dtype, native=True)
    python, python_calls, _ = greedy_tokens(folder, prompts, dtype, native=False)
    assert native == python
    assert stack_calls == steps > MAX_NEW_TOKENS and python_calls == 0
