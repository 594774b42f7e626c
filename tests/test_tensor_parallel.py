"""Tensor parallel on CPU ranks (gloo): the sharding's slices and refusals, and float32 greedy through the
offline API with TP=2 (and TP=4) equal to TP=1 and HF transformers token for token, on tiny models with
8/4 heads, KV heads replicated (4/1 at TP=2), Qwen2's biases and Qwen3's per-head norms, the families
with fused checkpoint tensors, row-parallel biases and sharded q/k norms, a vocabulary TP
does not divide, and SmolLM2 at TP=3 (its 9/3 heads refuse TP=2 in one line); with the batch-invariant
kernels a TP=2 row's logprobs do not depend on the rest of the batch."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from frontend import LLM, SamplingParams
from frontend.engine.process import EngineRefusedError
from tests.hf_oracle import compare_greedy, hf_greedy
from worker.model_config import ModelConfig
from worker.parallel.sharding import Shard, ShardingError, check_shardable, shard_config

pytestmark = pytest.mark.slow
VOCAB = 515  # odd: the last rank's vocabulary shard is padded
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def build(
    folder: str, family: str, heads: int, kv_heads: int, vocab_size: int = VOCAB, hidden_size: int = 64
) -> None:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=2048, initializer_range=0.3, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=family == "qwen3",
    )  # fmt: skip
    torch.manual_seed(heads * 10 + kv_heads)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_theta=1e6))
    with torch.no_grad():  # biases and norms away from their defaults, so a wrong shard of one shows
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1, 0.3)
            attention = layer.self_attn
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.3)
            if family == "qwen3":
                attention.q_norm.weight.normal_(1, 0.3)
                attention.k_norm.weight.normal_(1, 0.3)
    model.save_pretrained(folder)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(70)]
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 90))] for _ in range(4)] + [
        shared + [1],
        shared + [2],
    ]


def greedy(folder: str, tp: int, ids: list[list[int]], **options: object) -> list[list[int]]:
    with LLM(folder, tensor_parallel_size=tp, dtype="float32", num_kv_blocks=64, **options) as llm:
        results = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
        # every rank answers an operator's report, rank 0 first
        report = llm.run(llm.client.call_utility("collective_rpc", "report_memory", [], {}, None))
    assert len({rank["pid"] for rank in report["results"]}) == tp
    return [result.outputs[0].token_ids for result in results]


def greedy_tp1(
    folder: str, ids: list[list[int]], max_num_batched_tokens: int, max_model_len: int | None = None
) -> list[list[int]]:
    """TP=1 as `greedy` runs it, in this process: the same worker code as a rank's, without a second engine
    and worker start (each TP test used to pay one for its reference)."""
    from protocol.config import DEFAULT_BLOCK_SIZE
    from protocol.sampling import SamplingParams as EngineParams
    from tests.test_correctness_tiny import run_engine

    params = EngineParams(temperature=0.0, max_tokens=GREEDY.max_tokens)
    return run_engine(folder, ids, params, block_size=DEFAULT_BLOCK_SIZE, num_kv_blocks=64,
                      max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)[0]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "heads", "kv_heads", "tp"),
    [("llama", 8, 4, 2), ("llama", 4, 1, 2), ("qwen2", 8, 2, 4), ("qwen3", 4, 2, 2)],
    ids=["llama-8-4-tp2", "llama-4-1-tp2-kv-replicated", "qwen2-8-2-tp4-kv-replicated", "qwen3-4-2-tp2"],
)
def test_tp_greedy_equals_tp1_and_hf(tmp_path, family: str, heads: int, kv_heads: int, tp: int) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path)
    build(folder, family, heads, kv_heads)
    ids = prompts()
    # 16-token chunks: prefills cross steps, and the prefix cache serves the shared 70 tokens
    sharded = greedy(folder, tp, ids, max_num_batched_tokens=16)
    assert sharded == greedy_tp1(folder, ids, 16)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, ours in zip(ids, sharded, strict=True):
        compare_greedy(ours, hf_greedy(hf, prompt, GREEDY.max_tokens, eos_token_id=None))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_is_batch_invariant(tmp_path, tp: int) -> None:  # type: ignore[no-untyped-def]
    """A row's logprobs at TP=2 and TP=4 are the same alone and among seven others (bf16 where the CPU has
    it): with more than two ranks, a plain ring all-reduce's order of addition moves with the step's size
    (TP=4 fails without the ordered sum)."""
    folder = str(tmp_path)
    build(folder, "llama", 8, 4)
    ids = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    with LLM(
        folder, tensor_parallel_size=tp, dtype="bfloat16", num_kv_blocks=64, batch_invariant=True
    ) as llm:
        alone = llm.generate([{"prompt_token_ids": ids[0]}], params)[0].outputs[0]
        crowd = llm.generate([{"prompt_token_ids": p} for p in ids + ids[1:3]], params)[0].outputs[0]
    assert alone.token_ids == crowd.token_ids
    assert alone.logprobs == crowd.logprobs


@pytest.mark.long  # make test-long
def test_smollm2_tp3_equals_hf_and_tp2_is_refused(
    smollm2_gguf: str,
    hf_smollm2,
    capfd: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    from frontend.model_files import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf, None)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 17 + 25?"]
    ids = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for q in questions
    ]  # fmt: skip
    with LLM(
        smollm2_gguf, tensor_parallel_size=3, dtype="float32", max_model_len=512, num_kv_blocks=32
    ) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=24)
        )
    model = hf_smollm2
    for prompt, result in zip(ids, results, strict=True):
        compare_greedy(result.outputs[0].token_ids, hf_greedy(model, prompt, 24, eos_token_id=2))
    # each rank serves its slice of the Q4_1 blocks as they are (o and down: whole blocks of 32 input dims)
    assert capfd.readouterr().err.count("csrc linear_quant on the packed blocks") == 3
    refusal = "--tensor-parallel-size 2 does not divide the model's 9 attention heads (3 KV heads)"
    with pytest.raises(EngineRefusedError, match=re.escape(refusal)):  # the worker's reason, one line
        LLM(smollm2_gguf, tensor_parallel_size=2, max_model_len=512, num_kv_blocks=32, startup_timeout_s=120)
    log = capfd.readouterr().err
    assert refusal in log and "Traceback" not in log, log


# ---- the sharding alone (no processes) ----


def shape(heads: int, kv_heads: int, inter: int = 1536, family: str = "llama") -> ModelConfig:
    return ModelConfig(
        family=family, vocab_size=49152, hidden_size=576, intermediate_size=inter, num_layers=30,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip


def test_refusals_name_the_sizes() -> None:
    with pytest.raises(ShardingError, match=r"does not divide the model's 9 attention heads \(3 KV heads\)"):
        check_shardable(shape(9, 3), 2)
    with pytest.raises(ShardingError, match="neither divides nor is a multiple of the model's 6 KV heads"):
        check_shardable(shape(12, 6), 4)
    with pytest.raises(ShardingError, match="intermediate size 1537"):
        check_shardable(shape(8, 4, inter=1537), 2)
    with pytest.raises(ShardingError, match="an encoder"):
        check_shardable(shape(12, 12, family="bert"), 2)
    check_shardable(shape(9, 3), 3)  # SmolLM2 at TP=3: 3 heads and 1 KV head a rank
    check_shardable(shape(8, 2), 8)  # each KV head on 4 ranks


def test_slices_cover_each_tensor_once_and_replicate_kv_heads() -> None:
    config = shape(8, 2)
    q = torch.arange(8 * 64 * 4, dtype=torch.float32).view(8 * 64, 4)
    k = torch.arange(2 * 64 * 4, dtype=torch.float32).view(2 * 64, 4)
    down = torch.arange(4 * 1536, dtype=torch.float32).view(4, 1536)
    for size in (2, 4, 8):
        shards = [Shard(config, rank, size) for rank in range(size)]
        name = "model.layers.0.self_attn.{}.weight"
        assert torch.equal(torch.cat([s.tensor(name.format("q_proj"), q) for s in shards]), q)
        assert torch.equal(
            torch.cat([s.tensor("model.layers.0.mlp.down_proj.weight", down) for s in shards], 1), down
        )
        k_parts = [s.tensor(name.format("k_proj"), k) for s in shards]
        local = shard_config(config, size)
        for rank, part in enumerate(k_parts):
            assert part.shape[0] == local.num_kv_heads * 64
            head = rank * local.num_heads // (8 // 2)  # the KV head this rank's first q head reads
            assert torch.equal(part[:64], k[head * 64 : (head + 1) * 64])
    embed = torch.randn(515, 8)
    small = dataclasses.replace(shape(8, 4), vocab_size=515)
    parts = [Shard(small, rank, 2).tensor("model.embed_tokens.weight", embed) for rank in range(2)]
    assert [len(p) for p in parts] == [258, 258] and torch.equal(torch.cat(parts)[:515], embed)
    assert not parts[1][-1].any()  # the padding row


def test_fused_tensors_are_sliced_part_by_part_and_row_biases_kept_once() -> None:
    config = dataclasses.replace(shape(8, 2, inter=64), family="phi3")
    q_size, kv_size = 8 * 64, 2 * 64
    qkv = torch.randn(q_size + 2 * kv_size, 4)
    gate_up = torch.randn(128, 4)
    bias = torch.randn(576)
    for size in (2, 4):
        local = shard_config(config, size)
        for rank in range(size):
            shard = Shard(config, rank, size)
            part = shard.tensor("model.layers.1.self_attn.qkv_proj.weight", qkv)
            q, k, v = part.split([local.num_heads * 64, local.num_kv_heads * 64, local.num_kv_heads * 64])
            assert torch.equal(q, shard.tensor("model.layers.1.self_attn.q_proj.weight", qkv[:q_size]))
            assert torch.equal(k, shard.tensor("x.self_attn.k_proj.weight", qkv[q_size : q_size + kv_size]))
            assert torch.equal(v, shard.tensor("x.self_attn.v_proj.weight", qkv[q_size + kv_size :]))
            gate, up = shard.tensor("model.layers.0.mlp.gate_up_proj.weight", gate_up).chunk(2)
            width = 64 // size
            assert torch.equal(gate, gate_up[rank * width : (rank + 1) * width])
            assert torch.equal(up, gate_up[64 + rank * width : 64 + (rank + 1) * width])
            o_bias = shard.tensor("model.layers.0.self_attn.o_proj.bias", bias)
            assert torch.equal(o_bias, bias if rank == 0 else torch.zeros_like(bias))


def test_packed_weights_shard_along_whole_blocks_or_are_refused_by_name() -> None:
    from tests.test_kernels_quant import random_blocks
    from worker.quant.blocks import GgufBlocks
    from worker.quant.gguf_pack import Q

    config = dataclasses.replace(shape(8, 2, inter=512), hidden_size=512, vocab_size=515)
    rows = random_blocks(Q.Q4_K, 512, 512)  # the file's bytes, sane scales
    down = GgufBlocks(int(Q.Q4_K), rows, (512, 512))
    parts = [Shard(config, rank, 2).tensor("model.layers.0.mlp.down_proj.weight", down) for rank in range(2)]
    assert [p.shape for p in parts] == [(512, 256), (512, 256)]  # type: ignore[attr-defined]
    assert torch.equal(torch.cat([p.dequantize() for p in parts], 1), down.dequantize())  # type: ignore[attr-defined]
    with pytest.raises(ShardingError, match=r"down_proj.weight \(Q4_K, kept packed\): input dims \[128, 256\) are "
                       r"not whole Q4_K blocks of 256 dims; --quantization none"):  # fmt: skip
        Shard(config, 1, 4).tensor("model.layers.0.mlp.down_proj.weight", down)
    embed = GgufBlocks(int(Q.Q4_K), rows[: 515 % 512 + 256], (259, 512))
    last = Shard(dataclasses.replace(config, vocab_size=259), 1, 2).tensor("model.embed_tokens.weight", embed)
    assert last.shape == (130, 512) and not last.dequantize()[-1].any()  # type: ignore[attr-defined]


# (make test runs each kind of sharding once; the long tier the other families of the same kind)
@pytest.mark.parametrize("name", ["gemma2", pytest.param("smollm3", marks=pytest.mark.long)])
def test_a_family_beyond_llama_shards_and_equals_hf(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    """Gemma 2 (sandwich norms, soft-caps, windows of 8 on half its layers) and SmolLM3 (NoPE layers) at
    TP=2: the tokens of TP=1 and of HF."""
    from transformers import AutoModelForCausalLM

    from tests.family_models import build_family

    build_family(name, str(tmp_path))
    ids = [[t % 512 for t in p] for p in prompts() if len(p) > 8]  # every prompt crosses the window
    sharded = greedy(str(tmp_path), 2, ids, max_num_batched_tokens=16, max_model_len=256)
    assert sharded == greedy_tp1(str(tmp_path), ids, 16, max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, ours in zip(ids, sharded, strict=True):
        compare_greedy(ours, hf_greedy(hf, prompt, GREEDY.max_tokens, eos_token_id=None))


@pytest.mark.parametrize(
    ("name", "tp"),
    [
        ("phi3", 4),
        ("gpt_neox", 2),
        ("olmo2", 4),
        ("stablelm", 2),
        pytest.param("cohere", 2, marks=pytest.mark.long),  # per-head q/k norm weights, as StableLM
        pytest.param("starcoder2", 2, marks=pytest.mark.long),  # biases everywhere, as GPT-NeoX
        pytest.param("glm4", 2, marks=pytest.mark.long),  # a fused gate_up_proj, as Phi-3
    ],
)
def test_fused_biased_and_normed_families_shard_and_equal_hf(tmp_path, name: str, tp: int) -> None:  # type: ignore[no-untyped-def]
    """Phi-3's fused qkv_proj and gate_up_proj (TP=4: its 2 KV heads replicated), GPT-NeoX's head-by-head
    query_key_value and biases after o and down, OLMo 2's q/k norms over whole projections (TP=4: the sums
    of squares all-reduced, replicated KV heads counted alike), StableLM's and Command R's per-head q/k norm
    weights, StarCoder2's biases, GLM-4's fused gate_up_proj: greedy tokens of HF transformers."""
    from transformers import AutoModelForCausalLM

    from tests.family_models import build_family

    build_family(name, str(tmp_path))
    ids = [[t % 512 for t in p] for p in prompts() if len(p) > 8]
    sharded = greedy(str(tmp_path), tp, ids, max_num_batched_tokens=16, max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, ours in zip(ids, sharded, strict=True):
        compare_greedy(ours, hf_greedy(hf, prompt, GREEDY.max_tokens, eos_token_id=None))


def test_a_family_whose_shapes_do_not_shard_yet_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.family_models import build_family

    build_family("gpt_oss", str(tmp_path))
    with pytest.raises(EngineRefusedError, match="has biases on its experts' down products"):
        LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=32, startup_timeout_s=120)
