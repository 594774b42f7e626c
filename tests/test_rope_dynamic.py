"""Dynamic NTK rope served past max_position_embeddings, as transformers runs it: a prompt longer than the
limit rotates every key on the prompt's length, each generated token on its own (position + 1), and the
cache keeps each key as it was rotated. Our tokens equal a fresh HF model's on each prompt, with chunked
prefill and prefix caching on (prompts of different lengths share no blocks past the limit)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.family_models import COMMON, VOCAB
from tests.hf_oracle import hf_greedy
from tests.test_families import check, greedy_with_logprobs
from worker.models.rope import RotaryEmbedding

LIMIT, FACTOR = 32, 4.0  # max_position_embeddings; the positions served: LIMIT * FACTOR
SCALING = {"rope_type": "dynamic", "factor": FACTOR, "rope_theta": 1e4}


def _config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(**{**COMMON, "max_position_embeddings": LIMIT, "num_hidden_layers": 2,
                          "tie_word_embeddings": False, "rope_parameters": SCALING})  # fmt: skip


def test_each_rows_rotation_is_transformers_at_every_forward() -> None:
    """HF's rotary module, called forward after forward as generate calls it (one prompt, then one token
    at a time): our table rows for the same (position, prompt length) are its cos/sin, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config()
    dim = config.hidden_size // config.num_attention_heads
    scaling = {**SCALING, "max_position_embeddings": LIMIT}
    ours = RotaryEmbedding(dim, int(LIMIT * FACTOR), 1e4, scaling, torch.device("cpu"))
    for prompt_len in (9, LIMIT, 47):
        hf = LlamaRotaryEmbedding(config)  # a fresh model: transformers keeps the longest length seen
        x = torch.zeros(1, dtype=torch.float32)
        calls = [torch.arange(prompt_len)] + [torch.tensor([p]) for p in range(prompt_len, 70)]
        for positions in calls:
            cos, sin = hf(x, positions[None])
            rope = ours.prepare(positions, torch.float32, None, None, torch.full_like(positions, prompt_len))
            assert torch.equal(rope.cos[:, 0], cos[0]) and torch.equal(rope.sin[:, 0], sin[0]), (
                prompt_len,
                int(positions[0]),
            )


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder = str(tmp_path_factory.mktemp("llama_dynamic"))
    torch.manual_seed(5)
    LlamaForCausalLM(_config()).save_pretrained(folder)
    rng = random.Random(13)
    shared = [rng.randrange(VOCAB - 1) for _ in range(40)]
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in (7, LIMIT - 4, 45, 70)]
    # past the limit, one prefix under two prompt lengths is rotated twice: no block may be shared
    prompts += [shared + [1, 2, 3], shared + [4, 5, 6, 7, 8, 9]]
    oracle = []
    for prompt in prompts:  # a fresh model each: transformers' rope keeps the longest length it has seen
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        oracle.append(hf_greedy(hf, prompt, 40, None))
    return folder, prompts, oracle


@pytest.mark.parametrize("native", [True, False])
def test_generation_past_the_limit_equals_transformers(dynamic, native: bool) -> None:  # type: ignore[no-untyped-def]
    """Chunks of 16 tokens, prefix caching on, the csrc decoder stack and the Python layers: every prompt,
    short ones growing past the limit and long ones starting past it, equals HF token for token."""
    folder, prompts, oracle = dynamic
    tokens, logprobs, core = greedy_with_logprobs(
        folder,
        prompts,
        40,
        int(LIMIT * FACTOR),
        native,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    for ours, values, expected in zip(tokens, logprobs, oracle, strict=True):
        check(ours, values, expected)
