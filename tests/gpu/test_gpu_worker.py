"""The CUDA worker on a GPU (skipped without one, with the reason): greedy float32 equals HF transformers
on the GPU token for token; bf16 against HF's bf16 with a tolerance report; each attention backend against
the torch reference across head sizes, block sizes and batch shapes. `make gpu-check` runs these."""

from __future__ import annotations

import random

import pytest
import torch

from frontend import LLM, SamplingParams
from tests.hf_oracle import compare_greedy
from tests.test_tensor_parallel import build
from worker.attention.base import AttentionMetadata, PrefillChunk
from worker.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")


def hf_greedy_on_gpu(folder: str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=max_new_tokens
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_float32_greedy_equals_hf_on_the_gpu(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    from tests.hf_oracle import hf_greedy

    folder = str(tmp_path)
    build(folder, family, 8, 4)
    rng = random.Random(1)
    prompts = [[rng.randrange(515) for _ in range(rng.randint(3, 90))] for _ in range(6)]
    with LLM(folder, device="cuda", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16)
        )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the oracle, on the host
    for prompt, result in zip(prompts, results, strict=True):
        compare_greedy(result.outputs[0].token_ids, hf_greedy(hf, prompt, 16, eos_token_id=None))


def test_bf16_against_hf_bf16_with_a_tolerance_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Head size 64 in bf16: FlashInfer where it is usable, inside the model, with the KV cache sized from the
    GPU's memory by the profiling pass (no --num-kv-blocks)."""
    folder = str(tmp_path)
    build(folder, "llama", 8, 4, hidden_size=512)
    rng = random.Random(2)
    prompts = [[rng.randrange(515) for _ in range(40)] for _ in range(8)]
    with LLM(folder, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5) as llm:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16)
        )
    agree = []
    for prompt, result in zip(prompts, results, strict=True):
        theirs = hf_greedy_on_gpu(folder, prompt, 16, torch.bfloat16)
        ours = result.outputs[0].token_ids
        agree.append(
            next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
        )
    with capsys.disabled():
        print(f"\nbf16 vs HF bf16: tokens equal before the first difference, per prompt: {agree}")
    assert sum(agree) / len(agree) >= 4, agree  # bf16 ties diverge; most prompts agree for a while


def random_step(block_size: int, num_decode: int, prefill_lens: list[int], contexts: list[int], heads: int,
                kv_heads: int, head_dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]  # fmt: skip
    """A step's q/k/v, a paged cache holding each request's context, and its metadata, on the GPU."""
    rng = torch.Generator().manual_seed(block_size + num_decode + head_dim)
    seqs = [int(torch.randint(1, 200, (1,), generator=rng)) for _ in range(num_decode)]  # decode contexts
    seqs += [c + n for c, n in zip(contexts, prefill_lens, strict=True)]
    blocks_per = [-(-s // block_size) for s in seqs]
    perm = torch.randperm(sum(blocks_per) + 4, generator=rng)
    tables, start = [], 0
    for count in blocks_per:
        tables.append(perm[start : start + count])
        start += count
    cache = torch.randn(len(perm), 2, block_size, kv_heads, head_dim, generator=rng).to("cuda", dtype)
    num_tokens = num_decode + sum(prefill_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=rng).to("cuda", dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=rng).to("cuda", dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=rng).to("cuda", dtype)
    positions = [s - 1 for s in seqs[:num_decode]]
    for c, n in zip(contexts, prefill_lens, strict=True):
        positions += list(range(c, c + n))
    owners = list(range(num_decode)) + [num_decode + i for i, n in enumerate(prefill_lens) for _ in range(n)]
    slot_blocks = torch.tensor(
        [int(tables[o][p // block_size]) for o, p in zip(owners, positions, strict=True)]
    )
    metadata = AttentionMetadata(num_decode_tokens=num_decode, slot_block_ids=slot_blocks.cuda(),
                                 slot_offsets=(torch.tensor(positions) % block_size).cuda())  # fmt: skip
    if num_decode:
        width = max(blocks_per[:num_decode])
        padded = [torch.cat([t, t.new_zeros(width - len(t))]) for t in tables[:num_decode]]
        metadata.decode_block_tables = torch.stack(padded).cuda()
        metadata.decode_seq_lens = torch.tensor(seqs[:num_decode]).cuda()
    row = num_decode
    for i, (c, n) in enumerate(zip(contexts, prefill_lens, strict=True)):
        metadata.prefills.append(PrefillChunk(row, row + n, c, tables[num_decode + i].cuda()))
        row += n
    return q, k, v, cache, metadata


@pytest.mark.parametrize("backend_name", ["flashinfer", "xformers"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(
    "shape", [(8, [], []), (0, [37], [0]), (5, [20, 3], [64, 130])], ids=["decode", "prefill", "mixed"]
)
def test_each_backend_equals_the_torch_reference(
    backend_name: str, head_dim: int, block_size: int, shape
) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip(backend_name)
    num_decode, prefill_lens, contexts = shape
    heads, kv_heads, dtype = 8, 2, torch.bfloat16
    q, k, v, cache, metadata = random_step(
        block_size, num_decode, prefill_lens, contexts, heads, kv_heads, head_dim, dtype
    )
    if backend_name == "flashinfer":
        from worker.attention.flashinfer import FlashInferBackend

        backend = FlashInferBackend(torch.device("cuda"), dtype, heads, kv_heads, head_dim, block_size)
    else:
        from worker.attention.xformers import XformersBackend

        backend = XformersBackend()  # type: ignore[assignment]
    reference_cache = cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, reference_cache, metadata, head_dim**-0.5)
    metadata.scratch.clear()
    got = backend.forward(q, k, v, cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(cache, reference_cache)  # the same keys and values written
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def engine_run(folder: str, prompts: list[list[int]], budget: int = 2048, **worker_args):  # type: ignore[no-untyped-def]
    """Greedy tokens with each step's top-2 logprobs, through the scheduler on the GPU (in process, so the
    runner can be looked at): {request id: [(token, {token id: logprob} of the top 2 and the token)]}."""
    from engine_core.engine_core import EngineCore
    from protocol.config import EngineConfig, WorkerConfig
    from protocol.messages import AddRequest
    from protocol.sampling import SamplingParams as CoreParams
    from worker.executor import InprocExecutor

    worker = WorkerConfig(model=folder, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=16,
                          max_num_batched_tokens=budget, **worker_args)  # fmt: skip
    executor = InprocExecutor(worker)
    replays: list[int] = []
    graphs = executor.runner.graphs
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda size: (replays.append(size), replay(size))[1]  # type: ignore[method-assign]
    core = EngineCore(EngineConfig(worker=worker, max_num_seqs=16, max_num_batched_tokens=budget), executor)
    params = CoreParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i))  # fmt: skip
    steps: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            assert output.new_logprobs is not None
            for token, ids, values in zip(output.new_token_ids, output.new_logprobs.token_ids,
                                          output.new_logprobs.logprobs, strict=True):  # fmt: skip
                steps[output.request_id].append((token, dict(zip(ids, values, strict=True))))
    return steps, replays


@pytest.fixture
def flashinfer_tiny(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A tiny Llama of head size 64 (FlashInfer's), where FlashInfer is installed."""
    pytest.importorskip("flashinfer")
    build(str(tmp_path), "llama", 8, 4, hidden_size=512)
    return str(tmp_path)


def test_cuda_graphs_on_and_off_give_the_same_tokens(flashinfer_tiny: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """bf16 on FlashInfer: decode steps replayed from graphs (13 rows padded to 16, fewer as requests finish)
    give the eager run's tokens; where a prompt's tokens part, it is at a bf16 tie (the graphed run's token
    in the eager run's top 2, within 0.05 of its best logprob), and most prompts never part."""
    rng = random.Random(4)
    prompts = [[rng.randrange(515) for _ in range(rng.randint(5, 60))] for _ in range(13)]
    eager, none = engine_run(flashinfer_tiny, prompts, enforce_eager=True)
    graphed, replays = engine_run(flashinfer_tiny, prompts)
    assert not none and replays, "the graphed run was meant to replay its decode steps"
    assert 16 in replays, replays
    parted = parted_at_ties(graphed, eager)
    with capsys.disabled():
        print(
            f"\ngraphs vs eager: {len(prompts) - len(parted)}/{len(prompts)} prompts equal; parted at {parted}"
        )
    assert len(parted) <= len(prompts) // 4, parted


def parted_at_ties(ours: dict, theirs: dict) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    """Where each prompt's greedy tokens first differ, (request id, index); each such place a bf16 tie: our
    token in their top 2, within 0.05 of their best logprob."""
    parted = []
    for request_id, their_steps in theirs.items():
        our_steps = ours[request_id]
        first = next(
            (i for i, (a, b) in enumerate(zip(our_steps, their_steps, strict=True)) if a[0] != b[0]), None
        )
        if first is None:
            continue
        token, their_top = our_steps[first][0], their_steps[first][1]
        assert token in their_top and max(their_top.values()) - their_top[token] < 0.05, (
            request_id, first, our_steps[first], their_top,
        )  # fmt: skip
        parted.append((request_id, first))
    return parted


def test_chunked_prefill_on_flashinfer_equals_one_chunk(flashinfer_tiny: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """Prompts of 300-700 tokens in 64-token chunks (steps that sample nothing, where the host may run ahead
    of the GPU and FlashInfer's plans must not overtake their copies) against the same prompts in one chunk."""
    rng = random.Random(5)
    prompts = [[rng.randrange(515) for _ in range(rng.randint(300, 700))] for _ in range(4)]
    whole, _ = engine_run(flashinfer_tiny, prompts, enforce_eager=True)
    chunked, _ = engine_run(flashinfer_tiny, prompts, budget=64, enforce_eager=True)
    parted = parted_at_ties(chunked, whole)
    with capsys.disabled():
        print(
            f"\nchunked vs one chunk: {len(prompts) - len(parted)}/{len(prompts)} prompts equal; parted at {parted}"
        )
    assert len(parted) <= 1, parted
