"""LLaVA on our engine: greedy tokens equal HF transformers' generate token for token (float32) on a tiny
random checkpoint, alone and batched, one image or two a prompt, with prefix caching (the same image hits,
another image never shares), chunks that split an image's span, an encoder budget of one image a step, a
pool small enough to preempt, and async scheduling; bad spans are refused before they are queued.

The EngineCore runs with the in-process executor (real scheduler, real worker code, no processes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS
from tests.vlm_models import NUM_IMAGE_TOKENS, build_tiny_llava, image_input, pixels
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 12
VOCAB, IMAGE = 300, 299
N = NUM_IMAGE_TOKENS


def case(text_before: list[int], images: list[int], text_after: list[int]) -> tuple[list[int], list[int]]:
    """A prompt: text, then each image's span separated by a token, then text; and its image seeds."""
    prompt = list(text_before)
    for _ in images:
        prompt += [IMAGE] * N + [7]
    return prompt + text_after, images


def hf_generate(model, prompt: list[int], seeds: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    kwargs = {"pixel_values": torch.from_numpy(np.concatenate([pixels(s) for s in seeds]))} if seeds else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS, **kwargs,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("llava"))
    hf = build_tiny_llava(folder, VOCAB, IMAGE)
    cases = [
        case([1, 10, 11], [0], [12, 13]),
        case([1, 10, 11], [1], [12, 13]),  # the same text over another image: no KV shared
        case([1, 10, 11], [0], [12, 14, 15]),  # case 0's image again: its blocks hit
        case([1], [2, 3], [20]),  # two images
        case([], [4], [30, 31, 32]),  # the image first
        case([1, 40, 41, 42, 43], [], [44]),  # text only
    ]
    oracle = [hf_generate(hf, prompt, seeds) for prompt, seeds in cases]
    return folder, cases, oracle


def run_engine(folder: str, cases, **engine_kwargs):  # type: ignore[no-untyped-def]
    worker_keys = ("num_kv_blocks", "max_model_len", "attention_backend")
    worker_kwargs = {"num_kv_blocks": TINY_KV_TOKENS // 4}
    worker_kwargs.update({k: engine_kwargs.pop(k) for k in worker_keys if k in engine_kwargs})
    worker = WorkerConfig(model=folder, dtype="float32", block_size=4, **worker_kwargs)
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, (prompt, seeds) in enumerate(cases):
        offsets = [j for j in range(len(prompt)) if prompt[j] == IMAGE and (j == 0 or prompt[j - 1] != IMAGE)]
        items = [image_input(pixels(s), prompt, o, IMAGE) for s, o in zip(seeds, offsets, strict=True)]
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i, mm_inputs=items))  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    images = core.executor.runner.images  # type: ignore[attr-defined]
    tower_steps = []
    while core.has_unfinished_requests():
        outputs = core.step()
        for _, output in outputs:
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
        held = sum(image.embeds is not None for imgs in images.requests.values() for image in imgs)
        tower_steps.append(held)
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    assert not any(image.embeds is not None for imgs in images.requests.values() for image in imgs)
    return [tokens[str(i)] for i in range(len(cases))], core


CONFIGS = {
    "default": dict(),
    "prefix_caching": dict(enable_prefix_caching=True),
    "torch_attention": dict(attention_backend="torch"),
    "chunk_5": dict(max_num_batched_tokens=5),  # every image's span in pieces over several steps
    "tiny_pool_preemption": dict(num_kv_blocks=24, max_model_len=60, max_num_batched_tokens=64),
    "async_chunk_7": dict(async_scheduling=True, max_num_batched_tokens=7, enable_prefix_caching=True),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_llava, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_llava
    outputs, core = run_engine(folder, cases, **dict(CONFIGS[config_name]))
    for i, (ours, expected) in enumerate(zip(outputs, oracle, strict=True)):
        assert ours == expected, f"request {i}: {ours} != {expected}"
    if config_name == "tiny_pool_preemption":
        assert core.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"


def test_the_same_image_hits_and_another_never_shares(tiny_llava) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_llava
    (outputs, core) = run_engine(folder, [cases[0]], enable_prefix_caching=True)
    scheduler = core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for request_id, (prompt, seeds) in (("other", cases[1]), ("same", cases[2])):
        core.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=0, mm_inputs=[image_input(pixels(seeds[0]), prompt, 3, IMAGE)]))  # fmt: skip
        request = scheduler.requests[request_id]
        _, cached = scheduler.kv_cache.get_computed_blocks(request)
        expected = 0 if request_id == "other" else (3 + N + 1 + 2) // 4 * 4  # the blocks before their tails
        assert cached == expected, (request_id, cached)
        while core.has_unfinished_requests():
            core.step()
    assert outputs == [oracle[0]]


def test_one_image_a_step_when_the_budget_holds_one(tiny_llava) -> None:  # type: ignore[no-untyped-def]
    """A step budget of one image's embeddings runs one tower a step: a chunk stops before the next image."""
    folder, cases, oracle = tiny_llava
    outputs, core = run_engine(folder, cases, max_num_batched_tokens=N)
    assert outputs == oracle
    assert (
        core.scheduler.config.max_num_encoder_input_tokens == N == core.scheduler.config.encoder_cache_tokens
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_spans_are_refused(tiny_llava, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    """And an image the tower cannot take ends its request with an error: with async scheduling too, where
    the step after the failed one was planned before the failure came back (its second image's tower in it)."""
    folder, cases, _ = tiny_llava
    worker = WorkerConfig(model=folder, dtype="float32", block_size=4, num_kv_blocks=TINY_KV_TOKENS // 4)
    config = EngineConfig(worker=worker, async_scheduling=async_scheduling, max_num_batched_tokens=N + 2)
    core = EngineCore(config, InprocExecutor(worker))
    assert core.model_info.image_token_id == IMAGE and core.model_info.max_image_tokens == N
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt, _ = cases[0]
    good = image_input(pixels(0), prompt, 3, IMAGE)
    bad = {
        "no image goes with it": [],
        "outside the prompt": [msgspec_replace(good, offset=len(prompt) - 2)],
        "placeholders": [msgspec_replace(good, offset=2)],
    }
    for message, items in bad.items():
        with pytest.raises(InvalidParameterError, match=message):
            core.add_request(AddRequest(request_id="x", prompt_token_ids=prompt, sampling_params=params,
                                        arrival_time=0, mm_inputs=items))  # fmt: skip
    wrong_shape = msgspec_replace(good, tensors={"pixel_values": good.tensors["pixel_values"].__class__(
        good.tensors["pixel_values"].data[:-4], [1, 3, 56, 56], "float32")})  # fmt: skip
    core.add_request(AddRequest(request_id="y", prompt_token_ids=prompt, sampling_params=params, arrival_time=0,
                                mm_inputs=[wrong_shape]))  # fmt: skip
    two, seeds = cases[3]  # two images: the second's tower runs in the step after the first's
    second = image_input(pixels(seeds[1]), two, 1 + N + 1, IMAGE)
    core.add_request(AddRequest(request_id="z", prompt_token_ids=two, sampling_params=params, arrival_time=1,
                                mm_inputs=[msgspec_replace(wrong_shape, offset=1), second]))  # fmt: skip
    errors = []
    while core.has_unfinished_requests():
        errors += [output.error for _, output in core.step() if output.error is not None]
    assert len(errors) == 2 and all("image 0" in error.message for error in errors)
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    core.shutdown()


def msgspec_replace(struct, **changes):  # type: ignore[no-untyped-def]
    import msgspec

    return msgspec.structs.replace(struct, **changes)
