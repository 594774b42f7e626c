"""Idefics3 and SmolVLM on our engine: greedy tokens equal HF transformers' generate token for token (float32)
on tiny random checkpoints, with images of several shapes (so several tile counts, each tile framed by its
row and column tokens), two images in a prompt, prefix caching (the same image hits), chunks that split an
image's span, and async scheduling. The prompts are the API server's: its processing (frontend/vision/) of
the rendered text and each image, so they are checked equal to the processor's own first.

The EngineCore runs with the in-process executor (real scheduler, real worker code, no processes).
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from engine_core.engine_core import EngineCore
from frontend.vision.processing import VisionModel
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from structured_outputs.tokenizer import load_tokenizer
from tests.vlm_models import TILE_TOKENS, build_idefics3_folder, png_bytes
from worker.executor import InprocExecutor

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 10
# (image seeds and sizes, text): sizes of 5, 3 and 2+1 tiles... and the first image again
CASES = [
    ([(0, (80, 50))], "What is it?"),
    ([(1, (100, 30))], "What is it?"),
    ([(0, (80, 50))], "Describe it."),  # case 0's image again: its blocks hit
    ([(2, (30, 90)), (3, (64, 64))], "Compare them."),
    ([], "Just text."),
]


def prompt_text(processor, count: int, text: str) -> str:  # type: ignore[no-untyped-def]
    content = [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)  # type: ignore[no-any-return]


def prepared(architecture: str, gguf: str, folder: str):  # type: ignore[no-untyped-def]
    """A tiny checkpoint of the architecture, CASES as the API server sends them, and transformers' tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    tokenizer = load_tokenizer(gguf, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    hf = build_idefics3_folder(folder, tokenizer, architecture)
    processor = AutoProcessor.from_pretrained(folder)
    vision = VisionModel(processor, hf.config.image_token_id, 1 << 30)
    cases, oracle = [], []
    for images, text in CASES:
        pictures = [Image.open(io.BytesIO(png_bytes(seed, size))).convert("RGB") for seed, size in images]
        rendered = prompt_text(processor, len(images), text)
        inputs = processor(text=[rendered], images=pictures or None, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(
                **inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS
            )
        oracle.append(out[0, inputs["input_ids"].shape[1] :].tolist())
        ids = processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        processed = [vision.process(p, f"{seed}") for p, (seed, _) in zip(pictures, images, strict=True)]
        prompt, items = vision.expand(ids, processed)
        assert prompt == inputs["input_ids"][0].tolist(), "the API server's prompt is not the processor's"
        cases.append((prompt, items))
    return folder, cases, oracle


@pytest.fixture(scope="module")
def tiny_idefics3(smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    return prepared("Idefics3", smollm2_gguf, str(tmp_path_factory.mktemp("idefics3")))


def run_engine(folder: str, cases, **engine_kwargs):  # type: ignore[no-untyped-def]
    worker = WorkerConfig(model=folder, dtype="float32", block_size=4)
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))
    assert core.model_info.max_image_tokens == 5 * TILE_TOKENS  # 2x2 tiles and the whole image
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, (prompt, items) in enumerate(cases):
        core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                    arrival_time=i, mm_inputs=items))  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return [tokens[str(i)] for i in range(len(cases))], core


CONFIGS = {
    "default": dict(),
    "prefix_caching_chunk_7": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    "async": dict(async_scheduling=True, enable_prefix_caching=True, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_idefics3, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_idefics3
    tokens, core = run_engine(folder, cases, **CONFIGS[config_name])
    assert tokens == oracle
    if CONFIGS[config_name].get("enable_prefix_caching"):
        assert core.scheduler.kv_cache.prefix_cache_hits > 0  # case 2 reads case 0's image blocks


def test_smolvlm_matches_hf_generate(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SmolVLM2's model (its processor needs torchvision: the checkpoint is saved with Idefics3's)."""
    folder, cases, oracle = prepared("SmolVLM", smollm2_gguf, str(tmp_path))
    assert run_engine(folder, cases)[0] == oracle
