"""Operators' topologies: a frontend attached to a running engine, and a headless engine with two
attached frontends. Real processes on loopback."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.serve_helpers import free_engine_port, free_port, stop, wait_until

pytestmark = pytest.mark.slow


def start(*args: str) -> subprocess.Popen[bytes]:
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


ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128"]


def test_attach_a_frontend_to_a_running_server(smollm2_gguf: str) -> None:
    engine_port, first_port, second_port = free_engine_port(), free_port(), free_port()
    address = f"tcp://127.0.0.1:{engine_port}"
    first = start(smollm2_gguf, "--port", str(first_port), "--engine-address", address, *ENGINE_ARGS)
    second = None
    try:
        wait_until(lambda: healthy(first_port), 180, "the first server")
        expected = complete(first_port)
        second = start("--attach", address, "--port", str(second_port))
        wait_until(lambda: healthy(second_port), 120, "the attached frontend")
        assert complete(second_port) == expected  # same engine, same greedy output
        assert complete(first_port) == expected
        stop(second)  # a frontend leaving does not disturb the engine or the other frontend
        second = None
        assert complete(first_port) == expected
    finally:
        if second is not None:
            stop(second)
        stop(first)


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
