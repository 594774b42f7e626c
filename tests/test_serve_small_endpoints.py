"""The small endpoints and vLLM's server options through a real `engine serve` of a tiny random Llama
(SmolLM2's tokenizer): one server with several options on at once (--root-path, --fingerprint-mode
hash, two --middleware, --enable-force-include-usage, --response-role, dev mode), one over HTTPS whose certificate is
replaced while it runs, one serving hub ids from a hand-made Hugging Face cache offline. The pieces
without a server: tests/test_server_options.py."""

from __future__ import annotations

import json
import os
import pathlib
import re
import ssl
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from tests.serve_helpers import start_serve, stop, wait_until
from tests.small_helpers import MIDDLEWARE_HEADER, common_name_of, hub_cache, make_certificate
from tests.test_correctness_tiny import build_tiny

pytestmark = pytest.mark.slow

NAME = "org/tiny"  # a served name with a slash, as a hub id has
PREFIX = "/proxy"
SMALL = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "16"]
CHAT: dict[str, Any] = {
    "model": NAME,
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 4,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer, tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-llama-tokenizer"))
    tokenizer = smollm2_tokenizer
    build_tiny("llama", folder, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


def start(model: str, *flags: str, env: dict[str, str | None] | None = None, verify: Any = None):  # type: ignore[no-untyped-def]
    """`engine serve MODEL FLAGS` with the small engine flags, waited on until /health answers (over
    HTTPS when verify is given)."""
    served = start_serve(model, *SMALL, *flags, env=env, verify=verify)
    return served.process, served.base


@pytest.fixture(scope="module")
def base(tiny: str):  # type: ignore[no-untyped-def]
    process, url = start(
        tiny,
        "--served-model-name",
        NAME,
        "--root-path",
        PREFIX,
        "--fingerprint-mode",
        "hash",
        "--middleware",
        "tests.small_helpers.TaggingMiddleware",
        "--middleware",
        "tests.small_helpers.function_middleware",
        "--enable-force-include-usage",
        "--response-role",
        "narrator",
        "--max-log-len",
        "8",
        env={"ENGINE_SERVER_DEV_MODE": "1"},
    )
    try:
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def test_models_retrieve_and_the_v1_root(client: openai.OpenAI, base: str) -> None:
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("other/model")
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    root = httpx.get(f"{base}/v1", timeout=10).json()
    assert root["models"] == [NAME] and "/v1/chat/completions" in root["endpoints"]


def test_root_path_serves_both_with_and_without_the_prefix(base: str) -> None:
    for url in (f"{base}/v1/models", f"{base}{PREFIX}/v1/models"):
        assert httpx.get(url, timeout=10).json()["data"][0]["id"] == NAME
    assert httpx.get(f"{base}/openapi.json", timeout=10).json()["servers"] == [{"url": PREFIX}]
    prefixed = openai.OpenAI(base_url=f"{base}{PREFIX}/v1", api_key="none", max_retries=0, timeout=60)
    assert prefixed.chat.completions.create(**CHAT).choices[0].message.content is not None


def test_system_fingerprint_on_every_body_and_chunk(client: openai.OpenAI) -> None:
    fingerprint = client.chat.completions.create(**CHAT).system_fingerprint
    assert fingerprint is not None and re.fullmatch(r"engine-\d+\.\d+\.\d+-[0-9a-f]{8}", fingerprint)
    chunks = list(client.chat.completions.create(stream=True, **CHAT))
    assert chunks and {chunk.system_fingerprint for chunk in chunks} == {fingerprint}
    completion = client.completions.create(model=NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert completion.system_fingerprint == fingerprint


def test_response_role(client: openai.OpenAI) -> None:
    """--response-role names the answer's role; continuing the last message keeps that message's."""
    assert client.chat.completions.create(**CHAT).choices[0].message.role == "narrator"
    chunks = list(client.chat.completions.create(stream=True, **CHAT))
    assert chunks[0].choices[0].delta.role == "narrator"
    continued = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well,"}]}
    answer = client.chat.completions.create(
        **continued, extra_body={"continue_final_message": True, "add_generation_prompt": False}
    )
    assert answer.choices[0].message.role == "assistant"


def test_force_include_usage_ends_every_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(stream=True, **CHAT))  # no stream_options asked
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    pieces = list(client.completions.create(model=NAME, prompt="Hi", max_tokens=3, stream=True))
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 3


def test_both_middleware_kinds_run(base: str) -> None:
    response = httpx.get(f"{base}/v1/models", timeout=10)
    assert response.headers[MIDDLEWARE_HEADER] == "class"
    assert response.headers["x-test-function-middleware"] == "function"


def test_orca_load_report_when_asked(base: str) -> None:
    url = f"{base}/v1/chat/completions"
    text = httpx.post(url, json=CHAT, headers={"endpoint-load-metrics-format": "text"}, timeout=60)
    assert re.fullmatch(
        r"TEXT named_metrics\.kv_cache_usage_perc=[0-9.e-]+, named_metrics\.num_requests_waiting=[0-9.]+",
        text.headers["endpoint-load-metrics"],
    )
    as_json = httpx.post(url, json=CHAT, headers={"endpoint-load-metrics-format": "json"}, timeout=60)
    report = json.loads(as_json.headers["endpoint-load-metrics"].removeprefix("JSON "))
    assert set(report["named_metrics"]) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert "endpoint-load-metrics" not in httpx.post(url, json=CHAT, timeout=60).headers


def test_sagemaker_invocations_route_by_the_body(base: str) -> None:
    chat = httpx.post(f"{base}/invocations", json=CHAT, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(f"{base}/invocations", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert completion.json()["object"] == "text_completion"
    assert completion.json()["usage"]["completion_tokens"] == 2
    neither = httpx.post(f"{base}/invocations", json={"input": "Hi"}, timeout=10)
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    bad = httpx.post(f"{base}/invocations", json={"messages": "Hi"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert httpx.post(f"{base}/ping", timeout=10).status_code == 200  # SageMaker's health check


def test_server_info_in_dev_mode_shows_no_secret(base: str) -> None:
    info = httpx.get(f"{base}/server_info", timeout=120).json()
    assert info["engine"]["served_model_names"] == [NAME]
    assert info["server"]["root_path"] == PREFIX and info["server"]["api_keys"] == "0 key(s)"
    assert info["system_fingerprint"].startswith("engine-")
    assert info["system_env"]["engine"] == info["engine"]["engine_version"]


def test_https_with_a_certificate_replaced_while_serving(tiny: str, tmp_path: pathlib.Path) -> None:
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    make_certificate(key, cert, "first")
    pinned = str(tmp_path / "first.pem")
    with open(cert) as f, open(pinned, "w") as out:
        out.write(f.read())
    process, base = start(
        tiny, "--ssl-keyfile", key, "--ssl-certfile", cert, "--enable-ssl-refresh", verify=pinned
    )
    try:
        port = int(base.rsplit(":", 1)[1])
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, http_client=httpx.Client(verify=pinned)
        )
        answer = client.completions.create(model=tiny, prompt="Hi", max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens == 2
        assert httpx.get(f"{base}/server_info", verify=pinned, timeout=10).status_code == 404  # no dev mode
        make_certificate(key, cert, "second")

        def served() -> str:
            return common_name_of(ssl.get_server_certificate(("127.0.0.1", port), timeout=5))

        wait_until(lambda: served() == "second", 30, "the new certificate to be served")
        renewed = openai.OpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, http_client=httpx.Client(verify=cert)
        )
        assert renewed.models.list().data[0].id == tiny
    finally:
        stop(process)


def test_hub_ids_served_offline_from_the_cache(tiny: str, tmp_path: pathlib.Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    tokenizer_files = {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
    for name in os.listdir(tiny):  # the model's repository without a tokenizer; the tokenizer in another
        if name not in tokenizer_files:
            os.link(os.path.join(tiny, name), weights / name)
    hub_cache(tmp_path / "hub", "org/tiny-weights", str(weights))
    hub_cache(tmp_path / "hub", "org/tiny-tokenizer", tiny)
    process, base = start(
        "org/tiny-weights",
        "--tokenizer",
        "org/tiny-tokenizer",
        "--download-dir",
        str(tmp_path / "hub"),
        env={"HF_HUB_OFFLINE": "1"},
    )
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["org/tiny-weights"]  # the id as given
        answer = client.completions.create(model="org/tiny-weights", prompt="Hello there", max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens == 3  # text: the tokenizer's
    finally:
        stop(process)


def test_collect_env_prints_the_report() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "collect-env", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["torch"]["version"] == info["packages"]["torch"]
    assert info["cpu"]["num_cpus"] == os.cpu_count() and "csrc" in info["torch"]


def test_reset_prefix_cache_in_dev_mode(base: str) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "tell me about the sea " * 30}]}

    def cached() -> int:
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached()
    assert cached() > 0  # the second asks hit the first's blocks
    response = httpx.post(f"{base}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200 and response.json() == {"reset": True}
    assert cached() == 0
