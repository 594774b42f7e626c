"""`engine serve --uds PATH`: the API server listens on a Unix socket instead of a TCP port (the openai SDK and
curl reach it), a stale socket file is replaced and the file is removed at exit; and GET /tokenizer_info
behind --enable-tokenizer-info-endpoint (vLLM's; tests/test_serve_generate.py sees its 404 without)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from tests.serve_helpers import stop, wait_until

pytestmark = pytest.mark.slow


def test_a_unix_socket_server_with_tokenizer_info(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    path = str(tmp_path / "engine.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a dead server's socket file: replaced
    stale.close()
    command = [sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--uds", path, "--dtype", "float32",
               "--max-model-len", "256", "--enable-tokenizer-info-endpoint"]  # fmt: skip
    process = subprocess.Popen(command)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://engine", timeout=30)

    def healthy() -> bool:
        try:
            return client.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 180, "the server on its Unix socket")
        openai = OpenAI(base_url="http://engine/v1", api_key="none", http_client=client)
        answer = openai.completions.create(
            model=smollm2_gguf, prompt="The sky is", max_tokens=4, temperature=0
        )
        assert answer.choices[0].finish_reason == "length"
        curl = subprocess.run(["curl", "-sS", "--unix-socket", path, "http://engine/v1/models"], capture_output=True,
                              timeout=30, check=True)  # fmt: skip
        assert b'"object":"list"' in curl.stdout
        info = client.get("/tokenizer_info").json()
        assert info["tokenizer_class"] and "{%" in info["chat_template"]
        assert "vocab_file" not in info
    finally:
        client.close()
        stop(process)
    assert not os.path.exists(path)
