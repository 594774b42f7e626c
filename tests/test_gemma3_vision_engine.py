"""Gemma 3 with images on our engine: greedy tokens equal HF transformers' generate token for token (float32)
on a tiny random checkpoint, whose image tokens see each other both ways (transformers' mask for them) on
full and sliding layers (the window shorter than an image): one and two images a prompt, the same image
again (its blocks hit), chunks that would cut an image's run
(the scheduler keeps each span whole in a step), async scheduling and a pool small enough to preempt. The
prompts are the API server's (tests/vlm_engine.py): each image's text (blank lines around its markers) put in
the rendered text before it is tokenized, checked equal to the processor's own first."""

from __future__ import annotations

import os

import pytest

from protocol.errors import InvalidParameterError
from structured_outputs.tokenizer import load_tokenizer
from tests.vlm_engine import prepare_cases, run_engine
from tests.vlm_models import G3_TOKENS, build_gemma3_folder

pytestmark = pytest.mark.slow

CASES = [
    ([(0, (80, 50))], "What is it?"),
    ([(1, (60, 60)), (2, (50, 90))], "Compare them."),
    ([(0, (80, 50))], "Describe it."),  # case 0's image again: its blocks hit
    ([], "Just text, no picture."),
]


def prepared(gguf: str, folder: str, cases):  # type: ignore[no-untyped-def]
    tokenizer = load_tokenizer(gguf, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    hf = build_gemma3_folder(folder, tokenizer)
    return (folder, *prepare_cases(folder, hf, hf.config.image_token_index, cases))


@pytest.fixture(scope="module")
def tiny_gemma3(smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    return prepared(smollm2_gguf, str(tmp_path_factory.mktemp("gemma3")), CASES)


CONFIGS = {
    "default": dict(),
    # a chunk to 50 would cut the first image's run: it stops before it
    "chunk_50": dict(max_num_batched_tokens=50),
    "async_chunk_60": dict(async_scheduling=True, enable_prefix_caching=True, max_num_batched_tokens=60),
    "tiny_pool_preemption": dict(num_kv_blocks=40, max_model_len=150, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_gemma3, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_gemma3
    tokens, core = run_engine(folder, cases, **CONFIGS[config_name])
    assert tokens == oracle
    assert core.model_info.whole_image_spans and core.model_info.max_image_tokens == G3_TOKENS
    if CONFIGS[config_name].get("enable_prefix_caching"):
        assert core.scheduler.kv_cache.prefix_cache_hits > 0  # case 2 reads case 0's image blocks


def test_an_image_that_cannot_fit_a_step_is_refused(tiny_gemma3) -> None:  # type: ignore[no-untyped-def]
    folder, cases, _ = tiny_gemma3
    with pytest.raises(ValueError, match="below one image's 49 tokens"):
        run_engine(folder, [], max_num_batched_tokens=G3_TOKENS - 1)
    with pytest.raises(InvalidParameterError, match="computed in one step"):  # two images' span, one step
        import msgspec

        prompt, items = cases[1]
        wide = msgspec.structs.replace(items[0], length=items[1].offset + items[1].length - items[0].offset,
                                       num_embeds=2 * G3_TOKENS)  # fmt: skip
        run_engine(folder, [(prompt, [wide])], max_num_batched_tokens=64)
