"""Serving a Hugging Face folder (a tiny random Llama with no tokenizer): token-id prompts, sampling
defaults from generation_config.json, clear errors where a tokenizer would be needed."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.serve_helpers import serving
from tests.test_correctness_tiny import build_tiny

pytestmark = pytest.mark.slow
SECRET = "sk-secret-never-logged"
H = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-served"))
    build_tiny("llama", folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "max_new_tokens": 3}, f)
    flags = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64"]
    with serving(folder, *flags, "--served-model-name", "tiny", "other-name") as served:
        yield served.base


def test_generation_config_defaults_apply_when_the_request_is_silent(base: str) -> None:
    first = httpx.post(
        headers=H, url=f"{base}/v1/completions", json={"prompt": [1, 2, 3, 4]}, timeout=60
    ).json()
    second = httpx.post(
        f"{base}/v1/completions", json={"prompt": [1, 2, 3, 4], "model": "other-name"}, timeout=60
    ).json()
    assert first["usage"]["completion_tokens"] == 3  # max_new_tokens from generation_config.json
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # temperature 0 from the config
    explicit = httpx.post(
        f"{base}/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 5}, timeout=60
    ).json()
    assert explicit["usage"]["completion_tokens"] == 5


def test_served_names_and_no_tokenizer_errors(base: str) -> None:
    assert [m["id"] for m in httpx.get(f"{base}/v1/models", headers=H).json()["data"]] == [
        "tiny",
        "other-name",
    ]
    chat = httpx.post(
        headers=H, url=f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    text = httpx.post(headers=H, url=f"{base}/v1/completions", json={"prompt": "hello"})
    assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
    oov = httpx.post(headers=H, url=f"{base}/v1/completions", json={"prompt": [1, 99999]})
    assert oov.status_code == 400 and oov.json()["error"]["param"] == "prompt"
