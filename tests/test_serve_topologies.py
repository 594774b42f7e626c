"""Operators' topologies: a frontend attached to a running engine, and a headless engine with two
attached frontends. Real processes on loopback."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.serve_helpers import Served, free_engine_port, free_port, serving, start_serve, stop, wait_until

pytestmark = pytest.mark.slow


def start(*args: str) -> subprocess.Popen[bytes]:
    """A headless engine or its frontends, which start_serve cannot wait on (no HTTP, or no engine yet)."""
    return subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", *args])


def healthy(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def complete(port: int, prompt: str = "The sky is") -> str:
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def port_of(served: Served) -> int:
    return int(served.base.rsplit(":", 1)[1])


ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128"]


def test_attach_a_frontend_to_a_running_server(smollm2_gguf: str) -> None:
    with serving(smollm2_gguf, *ENGINE_ARGS, engine_address=True) as first:
        first_port = port_of(first)
        expected = complete(first_port)
        assert first.engine_address is not None
        second = start_serve(None, "--attach", first.engine_address, timeout_s=120)
        try:
            assert complete(port_of(second)) == expected  # same engine, same greedy output
            assert complete(first_port) == expected
        finally:
            stop(second.process)  # a frontend leaving does not disturb the engine or the other frontend
        assert complete(first_port) == expected


def test_headless_engine_with_two_attached_frontends(smollm2_gguf: str) -> None:
    engine_port, port_a, port_b = free_engine_port(), free_port(), free_port()
    address = f"tcp://127.0.0.1:{engine_port}"
    headless = start(smollm2_gguf, "--headless", "--engine-address", address, *ENGINE_ARGS)
    frontends = []
    try:
        frontends = [start("--attach", address, "--port", str(p)) for p in (port_a, port_b)]
        wait_until(lambda: healthy(port_a) and healthy(port_b), 180, "both attached frontends")
        assert complete(port_a, "Paris is") == complete(port_b, "Paris is")
    finally:
        for frontend in frontends:
            stop(frontend)
        stop(headless)
