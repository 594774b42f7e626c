"""Prompts with images as the API server makes them (frontend/vision/: the rendered text and each image
through the checkpoint's own processor), transformers' greedy tokens for them, and our engine's (the
EngineCore with the in-process executor: real scheduler, real worker code, no processes)."""

from __future__ import annotations

import io
from typing import Any

import torch

from engine_core.engine_core import EngineCore
from frontend.vision.processing import VisionModel
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS
from tests.vlm_models import png_bytes
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 10
Case = tuple[list[tuple[int, tuple[int, int]]], str]  # (image seeds and sizes, text)


def prepare_cases(
    folder: str, hf: Any, placeholder_id: int, cases: list[Case]
) -> tuple[list[Any], list[list[int]]]:
    """Each case's prompt and images as the API server sends them (checked equal to the processor's own
    prompt), and transformers' generate over the processor's outputs."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    vision = VisionModel(processor, placeholder_id, 1 << 30)
    prepared, oracle = [], []
    for images, text in cases:
        pictures = [Image.open(io.BytesIO(png_bytes(seed, size))).convert("RGB") for seed, size in images]
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        rendered = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        inputs = processor(text=[rendered], images=pictures or None, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(
                **inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS
            )
        oracle.append(out[0, inputs["input_ids"].shape[1] :].tolist())
        processed = [vision.process(p, f"{seed}") for p, (seed, _) in zip(pictures, images, strict=True)]
        prompt, items = vision.prompt(
            rendered, processed, lambda text: processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        )
        assert prompt == inputs["input_ids"][0].tolist(), "the API server's prompt is not the processor's"
        prepared.append((prompt, items))
    return prepared, oracle


def run_engine(folder: str, cases: list[Any], **engine_kwargs: Any) -> tuple[list[list[int]], EngineCore]:
    """Greedy tokens of each case, all queued at once; the scheduler's invariants checked every step, and
    every KV block free at the end."""
    worker_keys = ("num_kv_blocks", "max_model_len", "attention_backend")
    worker_kwargs = {"num_kv_blocks": TINY_KV_TOKENS // 4}
    worker_kwargs.update({k: engine_kwargs.pop(k) for k in worker_keys if k in engine_kwargs})
    worker = WorkerConfig(model=folder, dtype="float32", block_size=4, **worker_kwargs)
    core = EngineCore(EngineConfig(worker=worker, **engine_kwargs), InprocExecutor(worker))
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
