"""Every decoder family equals HF transformers (float32) on a tiny random checkpoint with its quirks turned
on (tests/family_models.py): the greedy tokens, and each token's logprob within 2e-4 of HF's (a missing
window, soft-cap or scale moves them long before it flips a token). All prompts in one batch in 16-token
chunks with the prefix cache on (two prompts share 32 tokens), and the longest alone in one chunk; windows
of 8 tokens are crossed by every prompt."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine_core.engine_core import EngineCore
from engine_core.hybrid_kv_cache import HybridKVCacheManager
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import BUILDERS, TINY_KV_TOKENS, VOCAB, build_family
from tests.hf_oracle import OracleRun, compare_greedy, hf_greedy
from worker.executor import InprocExecutor
from worker.kv_groups import window_pool_blocks

MAX_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-4


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folder = str(tmp_path_factory.mktemp(request.param))
    build_family(request.param, folder)
    auto = AutoModelForImageTextToText if request.param.endswith("_vlm") else AutoModelForCausalLM
    hf = auto.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB - 1) for _ in range(32)]
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (3, 9, 17, 40)]
    prompts += [shared + [1, 2, 3], shared + [4, 5, 6, 7]]
    oracle = [hf_greedy(hf, p, MAX_NEW_TOKENS, None) for p in prompts]
    return folder, prompts, oracle


def greedy_with_logprobs(
    folder: str,
    prompts: list[list[int]],
    max_tokens: int = MAX_NEW_TOKENS,
    max_model_len: int = 128,
    native: bool = True,  # False: the Python layers, not the csrc decoder stack
    **engine_kwargs: object,
) -> tuple[list[list[int]], list[list[float]], EngineCore]:
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, max_model_len=max_model_len,
                          num_kv_blocks=TINY_KV_TOKENS // 16)  # fmt: skip
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))  # type: ignore[arg-type]
    if not native:
        core.executor.runner.model.native_layers = None  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}

    def add(i: int) -> None:
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompts[i], sampling_params=params, arrival_time=i)
        )

    def step() -> None:
        for _, output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.new_logprobs is not None:
                logprobs[output.request_id].extend(row[0] for row in output.new_logprobs.logprobs)
        core.scheduler.check_invariants()

    for i in range(len(prompts) - 1):
        add(i)
    # the last prompt arrives once the one before it decodes: its shared prefix is cached by then
    while len(prompts) > 1 and not tokens[str(len(prompts) - 2)]:
        step()
    add(len(prompts) - 1)
    while core.has_unfinished_requests():
        step()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    keys = [str(i) for i in range(len(prompts))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys], core


def check(ours: list[int], logprobs: list[float], oracle: OracleRun) -> None:
    agreed = compare_greedy(ours, oracle).num_matching
    expected = [float(oracle.logprobs[i][token]) for i, token in enumerate(ours[:agreed])]
    torch.testing.assert_close(
        torch.tensor(logprobs[:agreed]), torch.tensor(expected), atol=LOGPROB_TOLERANCE, rtol=0
    )


def test_equals_hf_batched_chunked_and_cached(family) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = family
    tokens, logprobs, core = greedy_with_logprobs(
        folder, prompts, max_num_batched_tokens=16, enable_prefix_caching=True
    )
    for ours, values, expected in zip(tokens, logprobs, oracle, strict=True):
        check(ours, values, expected)
    assert core.scheduler.kv_cache.prefix_cache_hits >= 32, (
        core.scheduler.kv_cache.prefix_cache_hits
    )  # the second shared prompt found the first's


def test_equals_hf_alone(family) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = family
    tokens, logprobs, _ = greedy_with_logprobs(folder, prompts[3:4])
    check(tokens[0], logprobs[0], oracle[3])


BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
REFUSED = [
    ("GemmaForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("LlamaForCausalLM", {"pretraining_tp": 2}, "pretraining_tp"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "'mrope'"),
    ("LlamaForCausalLM", {"hidden_act": "quick_gelu"}, "quick_gelu"),
    ("Phi3ForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("CohereForCausalLM", {"partial_rotary_factor": 0.5}, "partial rope"),
    ("Olmo3ForCausalLM", {"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ("Qwen2ForCausalLM", {"layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window"),
    (
        "Gemma3ForCausalLM",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            }
        },
        "sliding layers",
    ),  # fmt: skip
    ("MambaForCausalLM", {}, "unsupported architecture"),
]


@pytest.mark.parametrize(
    ("architecture", "fields", "named"), REFUSED, ids=[f"{a}-{n}" for a, _, n in REFUSED]
)
def test_a_config_field_we_do_not_implement_is_refused_by_name(tmp_path, architecture, fields, named) -> None:  # type: ignore[no-untyped-def]
    import json

    from worker.config_files import load_model_config
    from worker.model_config import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **BASE, **fields}))
    with pytest.raises(UnsupportedModelError) as refused:
        load_model_config(str(tmp_path))
    assert named in str(refused.value), refused.value


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    ("name", "native", "targets"),
    [("gemma3", True, "all-linear"), ("olmo3", True, "all-linear"), ("starcoder2", True, "all-linear"),
     ("starcoder2", False, "all-linear"), ("gpt_neox", True, "all-linear"), ("phi3", True, "all-linear"),
     ("qwen3_moe", True, ATTENTION), ("qwen3_moe", False, ATTENTION), ("gpt_oss", True, ATTENTION)],
    ids=["gemma3", "olmo3", "starcoder2", "starcoder2-python-layers", "gpt_neox", "phi3", "qwen3_moe",
         "qwen3_moe-python-layers", "gpt_oss"],
)  # fmt: skip
def test_lora_on_a_family_equals_peft(name: str, native: bool, targets: Any, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An adapter on every linear product of a family beyond Llama's (sandwich and post norms, windows,
    multiplied logits; StarCoder2's plain MLP under its own names, c_fc and c_proj; GPT-NeoX's plain MLP
    and its head-by-head query_key_value; Phi-3's fused qkv_proj and gate_up_proj): our tokens equal peft's,
    and the base model's beside it in the same batch equal HF's. Mixtures of experts (Qwen3-MoE with its
    dense layers, gpt-oss with its sinks and windows) take adapters on their attention."""
    from transformers import AutoModelForCausalLM

    from protocol.lora import LoraAdapter, LoraConfig
    from tests.lora_helpers import make_adapter, peft_model

    build_family(name, str(tmp_path / "base"))
    make_adapter(str(tmp_path / "base"), str(tmp_path / "all"), 8, 16, targets, seed=3, scale=0.6)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (12, 30)]
    worker = WorkerConfig(model=str(tmp_path / "base"), dtype="float32", block_size=16, max_model_len=128,
                          num_kv_blocks=TINY_KV_TOKENS // 16, lora=LoraConfig(max_loras=2, max_lora_rank=8))  # fmt: skip
    core = EngineCore(
        EngineConfig(worker=worker, lora_modules=[LoraAdapter(name="all", path=str(tmp_path / "all"))]),
        InprocExecutor(worker),
    )
    if not native:  # the Python layers (as without the csrc stack), with the same adapter products
        core.executor.runner.model.native_layers = None  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    jobs = [(p, lora) for p in prompts for lora in ("all", None)]
    for i, (prompt, lora) in enumerate(jobs):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i, lora_name=lora))  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(jobs))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(jobs))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.new_logprobs is not None:
                logprobs[output.request_id].extend(row[0] for row in output.new_logprobs.logprobs)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    adapted = peft_model(str(tmp_path / "base"), str(tmp_path / "all"))
    for i, (prompt, lora) in enumerate(jobs):
        check(
            tokens[str(i)],
            logprobs[str(i)],
            hf_greedy(adapted if lora else base, prompt, MAX_NEW_TOKENS, None),
        )
    assert (tokens["0"], logprobs["0"]) != (tokens["1"], logprobs["1"]), "the adapter changes the output"


def test_a_model_windowed_on_every_layer_frees_the_blocks_behind_its_window(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mistral with an 8-token window on every layer: a request holds only the blocks its window and the
    step's tokens cover (the others back in the pool), its tokens still equal HF's, and a prompt sent again
    finds its prefix in the cache (freed blocks stay indexed) and equals HF's too."""
    from transformers import AutoModelForCausalLM

    build_family("mistral_window", str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(70)]
    worker = WorkerConfig(
        model=str(tmp_path), dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64
    )
    core = EngineCore(EngineConfig(worker=worker, max_num_batched_tokens=16), InprocExecutor(worker))
    assert core.model_info.kv_window == 8
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kv = core.scheduler.kv_cache
    for attempt in range(2):
        core.add_request(
            AddRequest(
                request_id=str(attempt), prompt_token_ids=prompt, sampling_params=params, arrival_time=0
            )
        )
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for _, output in core.step():
                tokens.extend(output.new_token_ids)
            core.scheduler.check_invariants()
            for blocks in kv.req_to_blocks.values():
                held = sum(block is not kv.behind for block in blocks)
                # the window's keys (8 tokens: up to 3 blocks of 4) and a 16-token chunk (4 more), plus one
                assert held <= 3 + 4 + 1, held
        compare_greedy(tokens, hf_greedy(hf, prompt, 40, None))
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.prefix_cache_hits >= 64  # the second time: the prompt's full blocks, freed but indexed


def test_a_model_mixing_windowed_and_full_layers_keeps_a_pool_for_each(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Gemma 3 (an 8-token window on some layers): the windowed layers' pool is sized for what windows hold
    (with memory given, the full layers get the rest: more blocks than one pool for all would have), a
    request holds only its window's blocks there and its whole context in the full pool, its tokens
    equal HF's, and a prompt sent again finds its prefix in both pools and equals HF's too."""
    from transformers import AutoModelForCausalLM

    build_family("gemma3", str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [random.Random(5).randrange(VOCAB - 1) for _ in range(70)]
    budget, memory = 16, 1 << 20
    worker = WorkerConfig(
        model=str(tmp_path),
        dtype="float32",
        block_size=4,
        max_model_len=128,
        kv_cache_memory_bytes=memory,
        max_num_seqs=2,
        max_num_batched_tokens=budget,
    )
    config = EngineConfig(worker=worker, max_num_batched_tokens=budget, max_num_seqs=2)
    core = EngineCore(config, InprocExecutor(worker))
    info = core.model_info
    one_pool = memory // (2 * 4 * 2 * 16 * 4 * 3)  # K and V of 4 tokens, 2 heads of 16, float32, 3 layers
    assert (info.kv_window, info.num_window_blocks) == (8, window_pool_blocks(8, 4, 2, budget))
    # two of the three layers are windowed: the one full layer gets what they leave
    assert info.num_kv_blocks == one_pool * 3 - info.num_window_blocks * 2 > one_pool
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kv = core.scheduler.kv_cache
    assert isinstance(kv, HybridKVCacheManager)
    oracle = hf_greedy(hf, prompt, 40, None)
    for attempt in range(2):
        core.add_request(
            AddRequest(
                request_id=str(attempt), prompt_token_ids=prompt, sampling_params=params, arrival_time=0
            )
        )
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for _, output in core.step():
                tokens.extend(output.new_token_ids)
            core.scheduler.check_invariants()
            for request_id, blocks in kv.sliding.req_to_blocks.items():
                held = sum(block is not kv.sliding.behind for block in blocks)
                assert held <= 3 + 4 + 1, held  # the window's 8 keys, a 16-token chunk, one more
                assert len(kv.full.req_to_blocks[request_id]) == len(blocks)
        compare_greedy(tokens, oracle)
        assert kv.pool.num_free_blocks == kv.pool.num_blocks
        assert kv.sliding.pool.num_free_blocks == kv.sliding.pool.num_blocks
    assert kv.prefix_cache_hits >= 64  # the second time: the prompt's full blocks, found in both pools


@pytest.mark.parametrize("name", ["gemma3", "gpt_neox"])
def test_a_family_as_an_embedder_equals_hf_last_hidden_state(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--convert embed` on a family beyond Llama's shape: each input's normalized last hidden state (after
    the final norm) equals HF's."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from frontend import LLM

    build_family(name, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (5, 33)]
    with LLM(str(tmp_path), convert="embed", dtype="float32", max_model_len=128) as llm:
        results = llm.embed([{"prompt_token_ids": p} for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        with torch.inference_mode():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        expected = torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1).numpy()
        assert float(np.dot(result.outputs.embedding, expected)) >= 0.99999


def test_gelu_on_bfloat16_is_torch_s_gelu_within_one_rounding() -> None:
    """The MLPs' GELU on bf16 runs in float32 and rounds once (torch's bf16 GELU is 15x slower on CPU):
    the values are torch's bf16 GELU's, up to one bf16 rounding."""
    import torch.nn.functional as F

    from worker.models.mlp import activation

    x = (torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    for name, approximate in (("gelu_tanh", "tanh"), ("gelu", "none")):
        ours, theirs = activation(name, x), F.gelu(x, approximate=approximate)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-8, atol=1e-6)
