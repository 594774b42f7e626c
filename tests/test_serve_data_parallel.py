"""`engine serve -dp 2` with real processes, through the openai SDK: both engines serve and give the same
greedy text, /metrics labels each engine, a long prompt sent again finds its prefix cached (it went to
the engine that holds it), X-data-parallel-rank picks the engine, a frontend attached to one engine reaches both, a headless node can run one
of the engines; and one engine killed mid-stream fails its requests, turns /health to 503 and stops the
launcher non-zero with no process left."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_helpers import free_engine_port, free_port, serving, stop, wait_until
from tests.test_reliability import stream_on

pytestmark = pytest.mark.slow
ENGINE_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--num-kv-blocks",
    "64",
    "--stats-log-interval",
    "0",
)
DOCUMENT = " ".join(f"Item {i} is a line of the inventory, kept for the audit." for i in range(60))


def engine_series(base: str, family: str) -> dict[str, float]:
    """engine label -> value of one engine family in /metrics."""
    text = httpx.get(f"{base}/metrics").text
    pattern = rf'^engine:{family}\{{engine="(\d+)",model_name="[^"]*"\}} ([0-9.e+]+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def by_engine(base: str, sample_name: str) -> dict[str, float]:
    """engine label -> the sum of a per-request family's samples (over its other labels) in /metrics."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == sample_name:
                engine = sample.labels["engine"]
                totals[engine] = totals.get(engine, 0.0) + sample.value
    return totals


def engines_of(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher.pid).children() if "engine_core.main" in " ".join(p.cmdline())]


def test_two_engines_behind_one_server(smollm2_gguf: str) -> None:
    with serving(
        smollm2_gguf, "-dp", "2", "--api-server-count", "2", *ENGINE_ARGS, engine_address=True
    ) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
        texts = [
            client.completions.create(model=smollm2_gguf, prompt="The capital of France is", max_tokens=12,
                                      temperature=0).choices[0].text
            for _ in range(6)
        ]  # fmt: skip
        assert len(set(texts)) == 1, texts  # whichever engine ran it
        generated = wait_until(lambda: (g := engine_series(served.base, "engine_generation_tokens_total"))
                               and len(g) == 2 and all(g.values()) and g, 30, "both engines' tokens")  # fmt: skip
        assert set(generated) == {"0", "1"}

        # a long prompt again: its prefix is cached where it went the first time
        messages = [{"role": "user", "content": DOCUMENT + "\nHow many items are there?"}]
        first = client.chat.completions.create(model=smollm2_gguf, messages=messages, max_tokens=4)
        again = client.chat.completions.create(model=smollm2_gguf, messages=messages, max_tokens=4)
        assert first.usage is not None and again.usage is not None and first.usage.prompt_tokens > 512
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens and details.cached_tokens >= 512, again.usage

        # the API servers' request families say which engine served each request, as vLLM's do
        served_by = by_engine(served.base, "engine:request_success_total")
        assert set(served_by) == {"0", "1"} and sum(served_by.values()) == 8, served_by
        for family in (
            "engine:time_to_first_token_seconds_count",
            "engine:e2e_request_latency_seconds_count",
            "engine:request_queue_time_seconds_count",
            "engine:prompt_tokens_total",
        ):
            assert set(by_engine(served.base, family)) == {"0", "1"}, family
        # each engine's tokens, as its frontends counted them, are the tokens it says it generated
        wait_until(lambda: by_engine(served.base, "engine:generation_tokens_total")
                   == engine_series(served.base, "engine_generation_tokens_total"), 30, "the same tokens")  # fmt: skip

        # X-data-parallel-rank (vLLM's header) puts a request on the engine it names; a rank no engine has is a 400
        before = by_engine(served.base, "engine:request_success_total")
        for _ in range(3):
            client.completions.create(model=smollm2_gguf, prompt="Hi", max_tokens=2,
                                      extra_headers={"X-data-parallel-rank": "1"})  # fmt: skip
        after = by_engine(served.base, "engine:request_success_total")
        assert (after["0"], after["1"]) == (before["0"], before["1"] + 3), (before, after)
        for rank in ("2", "one"):
            refused = httpx.post(f"{served.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                 headers={"X-data-parallel-rank": rank}, timeout=30)  # fmt: skip
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-data-parallel-rank"

        # a frontend attached to engine 0 finds engine 1 too
        assert served.engine_address is not None
        with serving(None, "--attach", served.engine_address) as attached:
            wait_until(lambda: set(engine_series(attached.base, "num_requests_running")) == {"0", "1"}, 30,
                       "both engines in the attached frontend's /metrics")  # fmt: skip


@pytest.mark.long  # make test-long
def test_a_headless_node_runs_one_of_the_engines(smollm2_gguf: str) -> None:
    rpc = ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_engine_port())]
    node = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--headless", "-dp", "2",
                             "--data-parallel-start-rank", "1", *rpc, *ENGINE_ARGS])  # fmt: skip
    try:
        with serving(
            smollm2_gguf, "-dp", "2", "--data-parallel-size-local", "1", *rpc, *ENGINE_ARGS
        ) as served:
            assert len(engines_of(served.process)) == 1
            client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
            for _ in range(4):
                client.completions.create(model=smollm2_gguf, prompt="Hello", max_tokens=4)
            tokens = engine_series(served.base, "engine_generation_tokens_total")
            assert set(tokens) == {"0", "1"} and all(tokens.values()), tokens
    finally:
        stop(node)


@pytest.mark.long  # make test-long
def test_one_engine_killed_mid_stream_fails_the_deployment_cleanly(smollm2_gguf: str) -> None:
    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--port", str(port),
                                 "-dp", "2", *ENGINE_ARGS])  # fmt: skip
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 180, "the server")
        streams = [stream_on(port, 900), stream_on(port, 900)]  # one on each engine (the first is busier)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        victim = engines_of(launcher)[1]
        victim.send_signal(signal.SIGKILL)
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503, 30, "/health 503")
        for stream in streams:
            stream.join(60)
            assert not stream.is_alive(), "a stream outlived its engine"
        assert any(s.error is not None and s.finish_reason is None for s in streams), [
            s.__dict__ for s in streams
        ]
        assert (
            httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ).status_code
            == 503
        )
        assert launcher.wait(timeout=60) != 0
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"orphans: {alive}"
    finally:
        if launcher.poll() is None:
            stop(launcher)
