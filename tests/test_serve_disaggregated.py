"""Disaggregated prefill and decode through HTTP: `engine proxy` in front of a prefill `engine serve`
(kv_producer) and a decode one (kv_consumer) sharing a KV folder, driven by the openai SDK. The proxy's
answers equal one engine's, token for token (chat streamed and not, completions, /inference/v1/generate);
the decode side loads the prompt's KV (its cached_tokens count the entry's blocks); errors of either side
reach the client in its shape; a dead prefill instance is a 502 naming it and /health says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_helpers import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow

BLOCK = 16  # a small block: short prompts hold whole blocks to transfer
STORY = "The lighthouse keeper climbed the stairs each night to light the lamp for the ships. " * 6


def start(command: list[str], port: int) -> tuple[subprocess.Popen[bytes], str]:
    return subprocess.Popen([sys.executable, "-m", "frontend.cli", *command, "--port", str(port)]), (
        f"http://127.0.0.1:{port}"
    )


# the NIXL pair in the long tier (make test-long): the engine tests read through NIXL in the quick one
@pytest.fixture(
    scope="module", params=["SharedStorageConnector", pytest.param("NixlConnector", marks=pytest.mark.long)]
)
def topology(
    smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Any]]:
    storage = tmp_path_factory.mktemp("kv")
    flags = ["--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK)]
    extra = {"shared_storage_path": str(storage)} if request.param != "NixlConnector" else {
        "side_channel_port": free_port()}  # fmt: skip
    processes, bases = [], []
    try:
        for role in ("kv_producer", "kv_consumer"):
            config = {"kv_connector": request.param, "kv_role": role, "kv_connector_extra_config": extra}
            process, base = start(["serve", smollm2_gguf, *flags, "--kv-transfer-config", json.dumps(config)],
                                  free_port())  # fmt: skip
            processes.append(process)
            bases.append(base)
        for process, base in zip(processes, bases, strict=True):
            wait_healthy(process, base)
        proxy, base = start(["proxy", "--prefill", bases[0], "--decode", bases[1]], free_port())
        processes.append(proxy)
        wait_healthy(proxy, base, 60)
        yield {
            "connector": request.param,
            "prefill": bases[0],
            "decode": bases[1],
            "proxy": base,
            "storage": storage,
            "processes": processes,
        }
    finally:
        for process in reversed(processes):
            stop(process)


def reference(topology: dict[str, Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One engine's answer: the prefill instance alone, its prefix cache kept apart by a salt."""
    answer = httpx.post(
        topology["prefill"] + path, json={**body, "cache_salt": f"alone-{len(body)}"}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_the_proxy_answers_as_one_engine(topology: dict[str, Any]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=topology["proxy"] + "/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": STORY + "Why did he climb?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})  # fmt: skip
    alone = reference(topology, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 24,
                                                         "temperature": 0, "return_token_ids": True})  # fmt: skip
    assert chat.choices[0].token_ids == alone["choices"][0]["token_ids"]  # type: ignore[attr-defined]
    assert chat.choices[0].message.content == alone["choices"][0]["message"]["content"]
    prompt = chat.usage.prompt_tokens
    assert (
        chat.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // BLOCK * BLOCK
    )  # loaded, not computed
    if topology["connector"] == "SharedStorageConnector":
        assert len(list(topology["storage"].iterdir())) == 1  # the prompt's entry
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == chat.choices[0].message.content
    )

    completion = client.completions.create(model=model, prompt=STORY, max_tokens=16, temperature=0)
    alone = reference(topology, "/v1/completions", {"model": model, "prompt": STORY, "max_tokens": 16,
                                                    "temperature": 0})  # fmt: skip
    assert completion.choices[0].text == alone["choices"][0]["text"]
    ids = httpx.post(topology["decode"] + "/tokenize", json={"prompt": STORY}, timeout=30).json()
    body = {"token_ids": ids["tokens"], "sampling_params": {"max_tokens": 16, "temperature": 0}}
    generated = httpx.post(topology["proxy"] + "/inference/v1/generate", json=body, timeout=120)
    assert generated.status_code == 200, generated.text
    assert generated.json()["choices"][0]["token_ids"] == reference(topology, "/inference/v1/generate", body)[
        "choices"][0]["token_ids"]  # fmt: skip


def test_errors_reach_the_client(topology: dict[str, Any]) -> None:
    bad = httpx.post(
        topology["proxy"] + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    twice = httpx.post(topology["proxy"] + "/v1/completions", json={"prompt": "hi", "n": 2}, timeout=30)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "kv_transfer_params"
    # a decode request naming an entry nobody wrote (kv_load_failure_policy "fail"): 400, nothing computed
    params: dict[str, Any] = {"do_remote_prefill": True}
    if topology["connector"] == "NixlConnector":  # (the engine tests read freed and expired entries)
        params = {**params, "remote_key": "ab" * 32, "remote_host": "127.0.0.1", "remote_port": 1}
    missing = httpx.post(topology["decode"] + "/v1/completions", json={"prompt": "Once more. " + STORY, "max_tokens": 2,
                                                                       "kv_transfer_params": params}, timeout=30)  # fmt: skip
    words = "another prompt's KV" if topology["connector"] == "NixlConnector" else "no KV for this prompt"
    assert missing.status_code == 400 and words in missing.json()["error"]["message"]
    # a producer request only a producer takes
    consumer = httpx.post(topology["decode"] + "/v1/completions", json={
        "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)  # fmt: skip
    assert consumer.status_code == 400 and "does not produce KV" in consumer.json()["error"]["message"]
    # the prefill instance dies: a 502 naming it, and /health says which
    stop(topology["processes"][0])
    dead = httpx.post(
        topology["proxy"] + "/v1/completions", json={"prompt": STORY, "max_tokens": 4}, timeout=30
    )
    assert dead.status_code == 502 and topology["prefill"] in dead.json()["error"]["message"]
    health = httpx.get(topology["proxy"] + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["instances"][topology["decode"]] == "healthy"


def test_proxy_flags_are_checked(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "frontend.cli", "proxy", "--prefill", "localhost:1", "--decode",
                             "http://127.0.0.1:2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "'localhost:1' is not an http(s) URL" in result.stderr
