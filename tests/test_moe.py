"""Mixture-of-experts models beyond their token-exactness against HF (tests/test_families.py has that for
mixtral, qwen2_moe, qwen3_moe and gpt_oss): gpt-oss's MXFP4 experts, batch-invariant greedy with the
fused experts step, and what is refused by name (LoRA, tensor parallel, another quantization)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS, VOCAB, build_family
from tests.hf_oracle import compare_greedy, hf_greedy
from worker.executor import InprocExecutor

MAX_TOKENS = 10


def greedy(
    folder: str, prompts: list[list[int]], dtype: str, batch: int, **worker: object
) -> dict[int, list]:
    """(token, logprob) per step of each prompt, `batch` prompts at a time arriving a step apart."""
    config = WorkerConfig(model=folder, dtype=dtype, block_size=16, max_model_len=256,  # type: ignore[arg-type]
                          num_kv_blocks=TINY_KV_TOKENS // 16, **worker)  # fmt: skip
    core = EngineCore(EngineConfig(worker=config, max_num_batched_tokens=48), InprocExecutor(config))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    out: dict[int, list] = {i: [] for i in range(len(prompts))}

    def step() -> None:
        for _, output in core.step():
            assert output.new_logprobs is not None
            row = [values[0] for values in output.new_logprobs.logprobs]
            out[int(output.request_id)].extend(zip(output.new_token_ids, row, strict=True))

    for start in range(0, len(prompts), batch):
        for i in range(start, min(start + batch, len(prompts))):
            core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompts[i], sampling_params=params,
                                        arrival_time=i))  # fmt: skip
            step()
        while core.has_unfinished_requests():
            step()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return out


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_greedy_is_batch_invariant(tmp_path, name: str, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Each prompt alone, then all 12 in flight together (their prefills in 48-token steps beside the
    others' decode rows, so experts are shared by rows of other requests): the same tokens and logprobs,
    bit for bit."""
    from worker.csrc_ops import load_cpu_ops

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: batch invariance needs the csrc kernels")
    build_family(name, str(tmp_path))
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    alone = greedy(str(tmp_path), prompts, dtype, batch=1)
    together = greedy(str(tmp_path), prompts, dtype, batch=12)
    assert all(len(steps) == MAX_TOKENS for steps in alone.values())
    assert together == alone


def test_mxfp4_dequantization_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from worker.models.mxfp4 import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 128, 40]
    assert dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2).equal(expected)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.bfloat16)


def _mxfp4(tensor: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales with `tensor`'s [E, rows, cols] shape (its values unused)."""
    experts, rows, cols = tensor.shape
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(121, 126, (experts, rows, cols // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_gpt_oss_mxfp4_experts_serve_as_their_dequantized_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales (as the released ones): our greedy
    tokens equal HF's on the same weights dequantized by transformers' own function."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    build_family("gpt_oss", str(tmp_path / "plain"))
    weights = load_file(str(tmp_path / "plain" / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    packed, dense = {}, {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # stored as [E, out, in / 32, 16]: the checkpoint's [E, in, out] is its dequantized transpose
            blocks, scales = _mxfp4(tensor.transpose(1, 2), generator)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = dense[name] = tensor
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    for folder, tensors, extra in (("packed", packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                   ("dense", dense, {})):  # fmt: skip
        (tmp_path / folder).mkdir()
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / folder / "model.safetensors")
        )
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, **extra}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    prompt = [random.Random(4).randrange(VOCAB) for _ in range(30)]
    expected = hf_greedy(hf, prompt, MAX_TOKENS, None)
    for quantization in ("mxfp4", "none"):  # kept packed (csrc MXFP4 products), and dequantized at load
        ours = greedy(str(tmp_path / "packed"), [prompt], "float32", batch=1, quantization=quantization)[0]
        assert [token for token, _ in ours] == expected.token_ids, quantization
    from worker.model_runner import ModelRunner
    from worker.models.experts import Experts

    runner = ModelRunner(WorkerConfig(model=str(tmp_path / "packed"), dtype="float32", max_model_len=64))
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.quantized is not None and m.gate_up_proj.numel() == 0 for m in experts)


BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16}  # fmt: skip
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


@pytest.mark.parametrize(
    ("architecture", "fields", "named"),
    [
        ("Qwen2MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("Qwen3MoeForCausalLM", {"num_experts": 0}, "num_experts"),
        ("GptOssForCausalLM", {"quantization_config": {"quant_method": "gptq"}}, "gptq"),
        ("DeepseekV3ForCausalLM", {}, "kv_lora_rank"),
        ("DeepseekV2ForCausalLM", {**MLA, "topk_method": "noaux_tc"}, "topk_method"),
        ("DeepseekV2ForCausalLM", {**MLA, "norm_topk_prob": True}, "norm_topk_prob"),
        ("DeepseekV2ForCausalLM", {**MLA, "moe_layer_freq": 2}, "moe_layer_freq"),
        ("DeepseekV3ForCausalLM", {**MLA, "topk_method": "greedy"}, "topk_method"),
    ],
)
def test_an_moe_config_we_do_not_run_is_refused_by_name(tmp_path, architecture, fields, named) -> None:  # type: ignore[no-untyped-def]
    from worker.config_files import load_model_config
    from worker.model_config import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **BASE, **fields}))
    with pytest.raises(UnsupportedModelError, match=named):
        load_model_config(str(tmp_path))


def test_what_lora_and_tensor_parallel_do_not_serve_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from protocol.errors import InvalidParameterError
    from protocol.lora import LoraConfig, LoraRequest
    from tests.lora_helpers import make_adapter
    from worker.config_files import load_model_config
    from worker.lora.manager import LoraManager
    from worker.model_config import UnsupportedModelError
    from worker.parallel.sharding import ShardingError, check_shardable

    build_family("qwen3_moe", str(tmp_path / "qwen3_moe"))
    config = load_model_config(str(tmp_path / "qwen3_moe"))
    LoraManager(
        LoraConfig(max_loras=1, max_lora_rank=8), config, torch.float32
    )  # its attention takes adapters
    build_family("qwen2_moe", str(tmp_path / "qwen2_moe"))
    adapter = make_adapter(
        str(tmp_path / "qwen2_moe"), str(tmp_path / "shared"), 4, 8, ["shared_expert_gate"]
    )
    manager = LoraManager(
        LoraConfig(max_loras=1, max_lora_rank=8),
        load_model_config(str(tmp_path / "qwen2_moe")),
        torch.float32,
    )
    with pytest.raises(
        InvalidParameterError,
        match=r"LoRA serves .* \(a mixture-of-experts model: its attention and its routed experts\)",
    ):
        manager.add(LoraRequest(lora_id=1, name="shared", path=adapter))
    build_family("deepseek_v3", str(tmp_path / "deepseek_v3"))
    with pytest.raises(UnsupportedModelError, match="latent attention has no LoRA slots"):
        LoraManager(
            LoraConfig(max_loras=1, max_lora_rank=8),
            load_model_config(str(tmp_path / "deepseek_v3")),
            torch.float32,
        )
    check_shardable(config, 2)  # experts 32 wide: TP=2 shards them
    with pytest.raises(ShardingError, match="experts' width 33"):
        check_shardable(dataclasses.replace(config, moe_intermediate_size=33), 2)
    build_family("gpt_oss", str(tmp_path / "gpt_oss"))
    with pytest.raises(ShardingError, match="biases on its experts' down products"):
        check_shardable(load_model_config(str(tmp_path / "gpt_oss")), 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("mixtral", marks=pytest.mark.long), "deepseek_v3"])
def test_experts_shard_by_width_and_equal_tp1_and_hf(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    """TP=2 through the offline API (two gloo ranks): each rank a half of every expert's width (Mixtral's
    w1/w3/w2 names; DeepSeek's shared experts), the router whole; DeepSeek's latent attention split by heads, its latent and
    cache whole on each rank; the tokens of TP=1 and of HF."""
    from transformers import AutoModelForCausalLM

    from tests.test_tensor_parallel import greedy as llm_greedy

    build_family(name, str(tmp_path))
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    sharded = llm_greedy(str(tmp_path), 2, prompts, max_num_batched_tokens=16, max_model_len=256)
    assert sharded == llm_greedy(str(tmp_path), 1, prompts, max_num_batched_tokens=16, max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, sharded, strict=True):
        compare_greedy(ours, hf_greedy(hf, prompt, len(ours), None))


def test_the_latent_pool_holds_a_row_a_token(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek's pool: one latent row (kv_lora_rank + qk_rope_head_dim = 32) a token and layer, no value
    half: the same bytes hold 4 heads x 24 x 2 / 32 = 6 times the tokens a grouped-query cache of its
    heads would."""
    build_family("deepseek_v3", str(tmp_path))
    budget = 1 << 20
    config = WorkerConfig(model=str(tmp_path), dtype="float32", block_size=16, kv_cache_memory_bytes=budget)
    runner = InprocExecutor(config).runner  # type: ignore[attr-defined]
    assert all(tuple(cache.shape[1:]) == (1, 16, 1, 32) for cache in runner.kv_caches)
    layers = len(runner.kv_caches)
    assert runner.num_kv_blocks == budget // (16 * 32 * 4 * layers)
    grouped = budget // (2 * 16 * 4 * 24 * 4 * layers)  # keys and values of its 4 heads of 24
    assert runner.num_kv_blocks >= 6 * grouped
