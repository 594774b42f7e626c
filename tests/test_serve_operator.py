"""The operator's engine controls through a real `engine serve` of SmolLM2 (two API servers, dev mode,
--profiler-dir) and a frontend attached to it: pause in each mode and resume, sleep at both levels and
wake (the worker's RSS before, asleep and after), collective_rpc, the profiler; each seen from every
frontend."""

from __future__ import annotations

import json
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serve_helpers import SHARED_API_KEY, Served, attached_frontend, serving, wait_until

pytestmark = pytest.mark.slow

DEV = {"ENGINE_SERVER_DEV_MODE": "1"}
PROMPT = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, profiles: pathlib.Path) -> Iterator[Served]:
    flags = [
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--api-server-count",
        "2",
        "--profiler-dir",
        str(profiles),
    ]
    with serving(smollm2_gguf, *flags, env=DEV, engine_address=True) as served:
        yield served


@pytest.fixture(scope="module")
def attached(server: Served) -> Iterator[Served]:
    with attached_frontend(server, env=DEV) as served:
        yield served


def post(served: Served, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(served.base + path, timeout=120, **kwargs)


def get(served: Served, path: str) -> Any:
    return httpx.get(served.base + path, timeout=30).json()


def complete(served: Served, max_tokens: int = 24, **extra: Any) -> Any:
    oa = openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=120)
    return oa.completions.create(
        model=get(served, "/v1/models")["data"][0]["id"], prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip


class Background:
    """A completion running on its own thread: its result or its error."""

    def __init__(self, served: Served, max_tokens: int) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(served, max_tokens))
        self.thread.start()

    def _run(self, served: Served, max_tokens: int) -> None:
        try:
            self.result = complete(served, max_tokens)
        except BaseException as error:  # noqa: BLE001 (the test reads it)
            self.error = error

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()


def running(served: Served) -> int:
    """The engine's running requests, asked now (/load's stats may be a heartbeat old on the other API server)."""
    return int(get(served, "/is_paused")["num_running"])


def test_pause_abort_ends_requests_and_503s_until_resume(server: Served, attached: Served) -> None:
    work = Background(server, 600)
    wait_until(lambda: running(server) == 1, 60, "the request runs")
    state = post(attached, "/pause?mode=abort").json()  # from the attached frontend
    assert state["is_paused"] and state["mode"] == "abort"
    work.join()
    assert work.result is not None and work.result.choices[0].finish_reason == "abort"
    for served in (server, attached):
        with pytest.raises(openai.InternalServerError) as refused:
            complete(served, 4)
        assert refused.value.status_code == 503 and "paused" in str(refused.value)
        health = httpx.get(served.base + "/health")
        assert health.status_code == 200 and health.json()["status"] == "paused"
        assert get(served, "/is_paused")["is_paused"] is True
    assert post(server, "/resume").json()["is_paused"] is False
    assert complete(attached, 4).choices[0].finish_reason == "length"


def test_pause_keep_resumes_exactly(server: Served) -> None:
    expected = complete(server, 64).choices[0].text
    work = Background(server, 64)
    wait_until(lambda: running(server) == 1, 60, "the request runs")
    assert post(server, "/pause?mode=keep").json()["mode"] == "keep"
    assert running(server) == 1 and work.thread.is_alive(), "frozen in place"
    post(server, "/resume")
    work.join()
    assert work.result.choices[0].text == expected


def test_pause_wait_answers_once_running_requests_end(server: Served) -> None:
    work = Background(server, 48)
    wait_until(lambda: running(server) == 1, 60, "the request runs")
    state = post(server, "/pause?mode=wait").json()
    assert state["num_running"] == 0
    work.join()
    assert work.result.choices[0].finish_reason == "length"
    queued = Background(server, 4)
    wait_until(lambda: get(server, "/is_paused")["num_waiting"] == 1, 60, "the new request waits")
    post(server, "/resume")
    queued.join()
    assert queued.result.choices[0].finish_reason == "length"


def rss(served: Served) -> int:
    body = post(served, "/collective_rpc", json={"method": "report_memory"}).json()
    return int(body["results"][0]["rss_bytes"])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake(
    server: Served, attached: Served, level: int, record_property, smollm2_gguf: str
) -> None:  # type: ignore[no-untyped-def]
    expected = complete(server, 16).choices[0].text
    before = rss(server)
    asleep = post(server, f"/sleep?level={level}")
    assert asleep.status_code == 200, asleep.text
    assert asleep.json()["is_sleeping"] and get(attached, "/is_sleeping")["is_sleeping"]
    sleeping_rss = rss(server)
    health = httpx.get(attached.base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "asleep"
    with pytest.raises(openai.InternalServerError, match="asleep"):
        complete(attached, 4)
    assert post(server, "/wake_up?tags=weights").json()["sleeping"] == ["kv_cache"]
    assert post(attached, "/wake_up").json()["is_sleeping"] is False
    after = rss(server)
    print(
        f"level {level}: worker RSS {before >> 20} MiB before, {sleeping_rss >> 20} asleep, {after >> 20} after"
    )
    record_property(f"rss_level_{level}", [before, sleeping_rss, after])
    # the weights are the file's blocks (tests/test_quantized_gguf.py): at least that much leaves
    assert before - sleeping_rss > 0.9 * os.path.getsize(smollm2_gguf), "the weights left the worker's memory"
    assert complete(server, 16).choices[0].text == expected


def test_sleep_refuses_while_requests_are_open_and_bad_levels(server: Served) -> None:
    work = Background(server, 200)
    wait_until(lambda: running(server) == 1, 60, "the request runs")
    refused = post(server, "/sleep?level=1")
    assert refused.status_code == 400 and "requests are open" in refused.json()["error"]["message"]
    work.join()
    assert post(server, "/sleep?level=3").status_code == 400
    assert post(server, "/pause?mode=later").status_code == 400
    assert post(server, "/pause?wait=1").status_code == 400


def test_collective_rpc_allowlist(server: Served, attached: Served) -> None:
    summary = post(attached, "/collective_rpc", json={"method": "model_summary", "timeout": 10}).json()
    assert summary["results"][0]["family"] == "llama"
    refused = post(server, "/collective_rpc", json={"method": "sleep", "args": [1]})
    assert refused.status_code == 400 and "collective_rpc calls only" in refused.json()["error"]["message"]
    assert post(server, "/collective_rpc", json={"method": "report_memory", "bogus": 1}).status_code == 400


def test_profiler_writes_the_workers_trace(server: Served, attached: Served, profiles: pathlib.Path) -> None:
    assert (
        post(attached, "/start_profile").status_code == 200
    )  # started through one frontend, stopped through another
    assert post(server, "/start_profile").status_code == 400  # one at a time
    complete(server, 4)
    trace = pathlib.Path(post(server, "/stop_profile").json()["trace"])
    assert trace.parent == profiles and json.loads(trace.read_text())["traceEvents"]


def test_without_dev_mode_the_controls_are_absent(smollm2_server: Served) -> None:
    headers = {"Authorization": f"Bearer {SHARED_API_KEY}"}
    for path in ("/pause", "/sleep", "/collective_rpc", "/start_profile", "/v1/load_lora_adapter"):
        assert httpx.post(smollm2_server.base + path, headers=headers).status_code == 404, path
