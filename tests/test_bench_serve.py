"""`engine bench serve --endpoint responses` against a stand-in server that streams the events our
Responses door builds (its own EventStream), so the harness reads the very frames the door sends: the
text from `response.output_text.delta`, the token count from the `response.completed` usage, and
`--responses-store both` sends each store setting the same load and reports their ratio."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from frontend.cli.main import main
from frontend.responses.output import EventStream, usage


def stream_of(body: dict[str, Any]) -> bytes:
    """What the door streams for a request: created, text deltas of one word each, completed. The last
    token adds no text (an end token), so only the usage counts every token."""
    events = EventStream()
    start = {"id": "resp_1", "object": "response", "status": "in_progress", "usage": None}
    frames = [events.event("response.created", response=start)]
    frames.append(events.event("response.in_progress", response=start))
    num_output_tokens = body["max_output_tokens"]
    for index in range(num_output_tokens - 1):
        frames += events.content(f" word{index}")
    frames += events.close()
    done = {**start, "status": "completed", "usage": usage(7, 0, num_output_tokens)}
    frames.append(events.event("response.completed", response=done))
    return b"".join(frames)


class StandIn:
    """An aiohttp server on a thread of its own: POST /v1/responses answers with stream_of(body)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def respond(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(stream_of(body))
        await response.write_eof()
        return response

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/responses", self.respond)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def __enter__(self) -> str:
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self.start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    server = StandIn()
    with server as base_url:
        yield server, base_url


LOAD = ["--model", "m", "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "6"]
LOAD += ["--output-len", "5", "--warmup", "0", "--quiet"]


def test_responses_endpoint_counts_the_doors_events(stand_in: tuple[StandIn, str], tmp_path: Path) -> None:
    server, base_url = stand_in
    out = tmp_path / "responses.json"
    argv = ["bench", "serve", "--base-url", base_url, "--endpoint", "responses", *LOAD]
    assert main([*argv, "--responses-store", "false", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0 and summary["store"] is False
    assert summary["total_output_tokens"] == 20 and summary["endpoint"] == "responses"
    # Tokens from the usage; times from the four text deltas: a first one and three gaps.
    assert all(r["ok"] and r["output_tokens"] == 5 and len(r["itls_s"]) == 3 for r in report["requests"])
    assert all(r["ttft_s"] > 0 for r in report["requests"])
    body = server.bodies[0]
    assert body["stream"] and body["store"] is False and body["max_output_tokens"] == 5
    assert isinstance(body["input"], str) and "stream_options" not in body and "messages" not in body


def test_responses_store_both_compares_the_two_in_one_run(
    stand_in: tuple[StandIn, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, base_url = stand_in
    out = tmp_path / "store.json"
    argv = ["bench", "serve", "--base-url", base_url, "--endpoint", "responses", *LOAD]
    assert main([*argv, "--responses-store", "both", "--rounds", "2", "--output-json", str(out)]) == 0
    # Round one stores first, round two does not: each setting sent its own load, in turns.
    assert [b["store"] for b in server.bodies] == [True] * 4 + [False] * 8 + [True] * 4
    assert len({b["input"] for b in server.bodies}) == 16  # fresh prompts for every pass
    report = json.loads(out.read_text())
    assert report["summary"]["store"] is True and report["no_store_summary"]["store"] is False
    assert len(report["rounds"]) == 2 and report["rounds"][0]["summary"] == report["summary"]
    for round_ in report["rounds"]:
        assert {round_[s]["total_output_tokens"] for s in ("summary", "no_store_summary")} == {20}
        assert round_["store_cost"]["output_throughput_ratio"] > 0
    assert "Output throughput, true / false:" in capsys.readouterr().out


def test_store_comparison_needs_the_responses_endpoint() -> None:
    with pytest.raises(SystemExit, match="is for --endpoint responses"):
        main(["bench", "serve", "--responses-store", "both"])
    with pytest.raises(SystemExit, match="needs --responses-store both"):
        main(["bench", "serve", "--endpoint", "responses", "--rounds", "2"])
