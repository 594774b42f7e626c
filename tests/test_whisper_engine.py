"""Whisper on our engine: greedy tokens equal HF transformers' generate token for token (float32) on tiny
random checkpoints, alone and batched, with prefix caching on and off, 4-token chunks, a pool small enough
to preempt, and async scheduling; the encoder budget and the store of encoder outputs hold their limits.

The EngineCore runs with the in-process executor (real scheduler, real worker code, no processes).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.media import EncoderInput
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 20
ENCODER_LEN = 60  # the tiny encoder's positions: its input has 120 frames


def build_tiny_whisper(folder: str, seed: int = 0, d_model: int = 64) -> None:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=300, num_mel_bins=16, d_model=d_model, encoder_layers=2, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=ENCODER_LEN, max_target_positions=96, decoder_start_token_id=1,
        pad_token_id=2, bos_token_id=2, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-zero biases and norms, so a missing one would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                param.normal_(0.5 if "layer_norm.weight" in name else 0.0, 0.3)
    model.save_pretrained(folder)


def features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, 2 * ENCODER_LEN)).astype(np.float32)


def encoder_input(array: np.ndarray) -> EncoderInput:
    data = array.tobytes()
    return EncoderInput(data, list(array.shape), hashlib.sha256(data).hexdigest(), ENCODER_LEN)


def hf_generate(model, array: np.ndarray, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' GenerationMixin.generate (greedy, the decoder prompt given, no Whisper-specific logit
    processors: the tiny checkpoint has no language or task tokens)."""
    from transformers import GenerationMixin

    with torch.inference_mode():
        out = GenerationMixin.generate(
            model,
            input_features=torch.from_numpy(array)[None],
            decoder_input_ids=torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS,  # as ignore_eos: every run is MAX_NEW_TOKENS long
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import WhisperForConditionalGeneration

    folder = str(tmp_path_factory.mktemp("whisper"))
    build_tiny_whisper(folder)
    hf = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 10, 11, 12]
    cases = [(features(i), prompt if i % 2 == 0 else [1, 40 + i]) for i in range(6)]
    cases.append((features(0), [1, 10, 11, 12, 13] * 4))  # 20 tokens: a full block shared with case 0's audio
    cases.append((features(7), [1, 10, 11, 12, 13] * 4))  # the same tokens over another audio
    oracle = [hf_generate(hf, array, p) for array, p in cases]
    return folder, cases, oracle


def run_engine(folder: str, cases, block_size: int = 4, **engine_kwargs):  # type: ignore[no-untyped-def]
    worker_keys = (
        "num_kv_blocks",
        "max_model_len",
        "kv_cache_memory_bytes",
        "max_num_seqs",
        "attention_backend",
    )
    worker_kwargs = {k: engine_kwargs[k] for k in worker_keys if k in engine_kwargs}
    for k in ("num_kv_blocks", "max_model_len", "kv_cache_memory_bytes", "attention_backend"):
        engine_kwargs.pop(k, None)
    worker = WorkerConfig(model=folder, dtype="float32", block_size=block_size, **worker_kwargs)
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, (array, prompt) in enumerate(cases):
        core.add_request(
            AddRequest(
                request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=i,
                encoder_input=encoder_input(array),
            )
        )  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    encoder_steps = []
    cross = core.executor.runner.cross  # type: ignore[attr-defined]
    recent: list[set[str]] = []  # the running and the finished requests of each step
    while core.has_unfinished_requests():
        waiting_encoders = sum(1 for r in core.scheduler.waiting if r.encoder_tokens_needed)
        outputs = core.step()
        for _, output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
        encoder_steps.append(
            waiting_encoders - sum(1 for r in core.scheduler.waiting if r.encoder_tokens_needed)
        )
        # the worker drops a finished or preempted request's encoder output with the next step it runs (as
        # its batch row; with async scheduling one more step is in flight), and holds no other
        recent.append({r.request_id for r in core.scheduler.running})
        recent.append({output.request_id for _, output in outputs if output.finish_reason})
        assert set(cross.entries) <= set().union(*recent[-6:])
        assert len(cross.entries) <= cross.max_entries
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return [tokens[str(i)] for i in range(len(cases))], core, encoder_steps


CONFIGS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "torch_attention": dict(attention_backend="torch"),  # cross-attention by SDPA per request, not csrc
    "chunk_4": dict(max_num_batched_tokens=4),
    "tiny_pool_preemption": dict(num_kv_blocks=16, max_model_len=48, max_num_batched_tokens=64),
    "async_tiny_pool_preemption": dict(
        async_scheduling=True, num_kv_blocks=16, max_model_len=48, max_num_batched_tokens=64
    ),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_whisper, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_whisper
    outputs, core, _ = run_engine(folder, cases, **dict(CONFIGS[config_name]))
    for i, (ours, expected) in enumerate(zip(outputs, oracle, strict=True)):
        assert ours == expected, f"request {i}: {ours} != {expected}"
    if config_name.endswith("tiny_pool_preemption"):
        assert core.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"


def test_a_query_scale_off_the_powers_of_two_and_a_last_block_part_full(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Head dim 12: the query's scale 12^-0.5 is applied to the stacked product's q columns in place, not
    folded into its rows: the encoder's rows and every layer's cross-attention keys and values equal
    transformers' in float32. Blocks of 16 leave the pool's last block of 60 positions 12 full."""
    from transformers import WhisperForConditionalGeneration

    from worker.csrc_ops import load_cpu_ops
    from worker.gguf_cache import load_model_files
    from worker.models import build_model

    build_tiny_whisper(str(tmp_path), seed=3, d_model=48)
    hf = WhisperForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    config, weights = load_model_files(str(tmp_path), None)
    ours = build_model(config, torch.float32, load_cpu_ops())
    ours.load_weights(weights.items() if isinstance(weights, dict) else weights)
    ours.finalize(True)
    x = torch.from_numpy(features(0))[None]
    with torch.inference_mode():
        encoded = hf.model.encoder(x).last_hidden_state[0]
        torch.testing.assert_close(ours.encoder(x)[0], encoded, rtol=1e-5, atol=1e-5)
        kv = ours.encode(x)[0]  # [positions, layers, k | v, heads, head_dim]
        for i, layer in enumerate(hf.model.decoder.layers):
            torch.testing.assert_close(kv[:, i, 0].flatten(1), layer.encoder_attn.k_proj(encoded))
            torch.testing.assert_close(kv[:, i, 1].flatten(1), layer.encoder_attn.v_proj(encoded))
    cases = [(features(i), [1, 10 + i, 11]) for i in range(3)]
    outputs, _, _ = run_engine(str(tmp_path), cases, block_size=16)
    assert outputs == [hf_generate(hf, array, prompt) for array, prompt in cases]


def test_alone_equals_batched(tiny_whisper) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_whisper
    alone, _, _ = run_engine(folder, [cases[3]])
    assert alone == [oracle[3]]


def test_the_encoder_budget_holds_one_input_a_step(tiny_whisper) -> None:  # type: ignore[no-untyped-def]
    """A step budget below two inputs' encoder positions starts one new request a step: running decodes go
    on between them (8 requests, 8 steps that each encode one)."""
    folder, cases, oracle = tiny_whisper
    outputs, core, encoder_steps = run_engine(folder, cases, max_num_batched_tokens=ENCODER_LEN)
    assert outputs == oracle
    assert core.scheduler.config.max_num_encoder_input_tokens == ENCODER_LEN
    assert max(encoder_steps) == 1 and sum(encoder_steps) == len(cases)


def test_the_store_bounds_the_running_requests(tiny_whisper) -> None:  # type: ignore[no-untyped-def]
    """A KV budget that holds two requests' encoder outputs (and their decoder blocks) runs two at a time."""
    folder, cases, oracle = tiny_whisper
    per_entry = 3 * 2 * ENCODER_LEN * 64 * 4  # decoder layers x (k, v) x positions x d_model x float32
    per_request = per_entry + 24 * (2 * 4 * 64 * 3 * 4)  # and 96 positions' blocks of 4 tokens
    outputs, core, _ = run_engine(folder, cases, kv_cache_memory_bytes=2 * per_request + 100)
    assert outputs == oracle
    assert core.model_info.max_num_encoder_outputs == 2 and core.scheduler.config.max_num_seqs == 2


def test_requests_must_carry_the_models_input(tiny_whisper) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = tiny_whisper
    worker = WorkerConfig(model=folder, dtype="float32", block_size=4)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    assert core.model_info.runner == "transcription" and core.model_info.encoder_len == ENCODER_LEN
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidParameterError, match="needs its audio"):
        core.add_request(
            AddRequest(request_id="a", prompt_token_ids=[1], sampling_params=params, arrival_time=0)
        )
    wrong = encoder_input(np.zeros((16, 10), dtype=np.float32))
    with pytest.raises(InvalidParameterError, match="shape"):
        core.add_request(
            AddRequest(request_id="b", prompt_token_ids=[1], sampling_params=params, arrival_time=0,
                       encoder_input=wrong)
        )  # fmt: skip
    core.shutdown()
