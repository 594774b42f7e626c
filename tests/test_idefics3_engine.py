"""Idefics3 and SmolVLM on our engine: greedy tokens equal HF transformers' generate token for token (float32)
on tiny random checkpoints, with images of several shapes (so several tile counts, each tile framed by its
row and column tokens), two images in a prompt, prefix caching (the same image hits), chunks that split an
image's span, and async scheduling. The prompts are the API server's (tests/vlm_engine.py), checked equal to
the processor's own first."""

from __future__ import annotations

import os

import pytest

from structured_outputs.tokenizer import load_tokenizer
from tests.vlm_engine import prepare_cases, run_engine
from tests.vlm_models import TILE_TOKENS, build_idefics3_folder

pytestmark = pytest.mark.slow

CASES = [
    ([(0, (80, 50))], "What is it?"),  # 2 x 2 tiles and the whole image
    ([(1, (100, 30))], "What is it?"),  # 1 x 2 and the whole
    ([(0, (80, 50))], "Describe it."),  # case 0's image again: its blocks hit
    ([(2, (30, 90)), (3, (64, 64))], "Compare them."),
    ([], "Just text."),
]


def prepared(architecture: str, gguf: str, folder: str):  # type: ignore[no-untyped-def]
    tokenizer = load_tokenizer(gguf, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    hf = build_idefics3_folder(folder, tokenizer, architecture)
    return (folder, *prepare_cases(folder, hf, hf.config.image_token_id, CASES))


@pytest.fixture(scope="module")
def tiny_idefics3(smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    return prepared("Idefics3", smollm2_gguf, str(tmp_path_factory.mktemp("idefics3")))


CONFIGS = {
    "default": dict(),
    "prefix_caching_chunk_32": dict(enable_prefix_caching=True, max_num_batched_tokens=32),  # images: 75-125
    "async": dict(async_scheduling=True, enable_prefix_caching=True, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_idefics3, config_name: str) -> None:  # type: ignore[no-untyped-def]
    folder, cases, oracle = tiny_idefics3
    tokens, core = run_engine(folder, cases, **CONFIGS[config_name])
    assert tokens == oracle
    assert core.model_info.max_image_tokens == 5 * TILE_TOKENS  # 2x2 tiles and the whole image
    if CONFIGS[config_name].get("enable_prefix_caching"):
        assert core.scheduler.kv_cache.prefix_cache_hits > 0  # case 2 reads case 0's image blocks


def test_smolvlm_matches_hf_generate(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SmolVLM2's model (its processor needs torchvision: the checkpoint is saved with Idefics3's)."""
    folder, cases, oracle = prepared("SmolVLM", smollm2_gguf, str(tmp_path))
    assert run_engine(folder, cases)[0] == oracle
