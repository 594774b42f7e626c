"""A soak and a fuzz against one real server with two API servers.

Soak: ENGINE_SOAK_REQUESTS (600; 2,000, then 1,200, before the suite outgrew 15 minutes) requests at concurrency 64, mixed streamed and not, 10% of clients
leaving mid-stream, 5% invalid. Afterwards every valid request completed (or got an error), no 5xx,
the engine is idle with no KV block in use, and each process's RSS growth is printed.
Fuzz: schemathesis generates requests from the server's own OpenAPI schema; no 5xx, no hang, and the
server is healthy afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import shutil
import subprocess
from typing import Any

import httpx
import psutil
import pytest

from tests.serve_helpers import serving, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long
KEY = "sk-soak"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    # A request that sets no length (a Responses input is any string) stops at 16 tokens, not at the
    # context limit: the fuzzer's valid requests then take ~0.1 s each instead of ~0.8.
    defaults = tmp_path_factory.mktemp("generation-config")
    (defaults / "generation_config.json").write_text(json.dumps({"max_new_tokens": 16}))
    flags = [
        "--api-server-count", "2", "--max-model-len", "160", "--num-kv-blocks", "512",
        "--api-key", KEY, "--stats-log-interval", "0", "--generation-config", str(defaults),
    ]  # fmt: skip
    with serving(smollm2_gguf, *flags) as served:
        yield {"base": served.base, "process": served.process}


def rss(process: subprocess.Popen[bytes]) -> dict[str, int]:
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    return {f"{p.pid} {' '.join(p.cmdline()[1:4])}": p.memory_info().rss for p in tree}


def assert_idle(base: str) -> None:
    def idle() -> bool:
        engine = httpx.get(f"{base}/load", headers=H).json()["engine"]
        return engine["num_running"] == 0 and engine["num_waiting"] == 0 and engine["kv_cache_usage"] == 0

    wait_until(idle, 30, "the engine to be idle with no KV block in use")  # fmt: skip


INVALID = [
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "n": 1000},
    {"prompt": "x", "model": "no-such-model"},
    {"prompt": [], "max_tokens": 2},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": "x" * 4000, "max_tokens": 2},
]


async def soak(base: str, total: int, concurrency: int, seed: int) -> collections.Counter[str]:
    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        roll = rng.random()
        words = " ".join(
            rng.choice(["red", "blue", "cat", "sky", "run", "tree"]) for _ in range(rng.randint(3, 30))
        )
        body: dict[str, Any] = {"prompt": words, "max_tokens": rng.randint(1, 12), "temperature": 0.7}
        async with semaphore:
            if roll < 0.05:
                response = await client.post("/v1/completions", json=rng.choice(INVALID))
                outcomes[
                    "invalid 4xx" if 400 <= response.status_code < 500 else f"invalid {response.status_code}"
                ] += 1
                return
            if roll < 0.15:  # leaves mid-stream
                body.update(max_tokens=100, stream=True, ignore_eos=True)
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = 0
                    async for _ in response.aiter_lines():
                        lines += 1
                        if lines >= 3:
                            break
                outcomes[
                    "disconnected" if response.status_code == 200 else f"disconnect {response.status_code}"
                ] += 1
                return
            if roll < 0.575:
                body["stream"] = True
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                ok = response.status_code == 200 and events[-1] == "data: [DONE]"
                finished = any(
                    '"finish_reason":"length"' in e or '"finish_reason":"stop"' in e for e in events
                )
                outcomes["stream ok" if ok and finished else f"stream bad {response.status_code}"] += 1
                return
            response = await client.post("/v1/completions", json=body)
            ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in (
                "length",
                "stop",
            )
            outcomes["plain ok" if ok else f"plain {response.status_code}"] += 1

    # fmt: skip

    async with httpx.AsyncClient(base_url=base, headers=H, timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(total)))
    return outcomes


def test_soak(server) -> None:  # type: ignore[no-untyped-def]
    total = int(os.environ.get("ENGINE_SOAK_REQUESTS", "600"))
    before = rss(server["process"])
    outcomes = asyncio.run(soak(server["base"], total, concurrency=64, seed=1))
    print(f"\nsoak outcomes: {dict(outcomes)}")
    assert sum(outcomes.values()) == total
    bad = {
        k: v for k, v in outcomes.items() if k not in ("invalid 4xx", "disconnected", "stream ok", "plain ok")
    }
    assert not bad, bad  # no 5xx, no broken stream, every valid request completed
    assert outcomes["disconnected"] > 0 and outcomes["invalid 4xx"] > 0
    assert_idle(server["base"])
    metrics = httpx.get(f"{server['base']}/metrics").text
    five_xx = [
        line
        for line in metrics.splitlines()
        if line.startswith("engine:http_requests_total") and 'status="5' in line
    ]
    assert not five_xx, five_xx
    after = rss(server["process"])
    for name, start in before.items():
        if name in after:
            print(
                f"RSS {name}: {start / 2**20:.0f} -> {after[name] / 2**20:.0f} MiB ({(after[name] - start) / 2**20:+.0f})"
            )
    # fmt: skip


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis is not installed")
def test_fuzz_from_openapi_schema(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = server["base"]
    run = subprocess.run(
        ["schemathesis", "run", f"{base}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", os.environ.get("ENGINE_FUZZ_EXAMPLES", "15"), "--header", f"Authorization: Bearer {KEY}",
         "--request-timeout", "60", "--seed", "1", "--report", "ndjson", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,  # its cache stays out of the repo
    )  # fmt: skip
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert httpx.get(f"{base}/health").status_code == 200
    assert_idle(base)
    events = [json.loads(line) for f in tmp_path.glob("*.ndjson") for line in f.read_text().splitlines()]
    assert events  # the fuzzer did send requests
