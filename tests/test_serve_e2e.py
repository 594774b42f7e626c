"""End to end: a real `engine serve` (engine, worker, two API servers) on loopback, driven by the
official `openai` client and by raw HTTP."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from tests.serve_helpers import (
    SHARED_API_KEY,
    SHARED_MODEL_NAME,
    Served,
    listeners_report,
    start_serve,
    stop,
    wait_until,
)

pytestmark = pytest.mark.slow

API_KEY = SHARED_API_KEY
MODEL = SHARED_MODEL_NAME


def start_server(model: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """A server of its own, with the shared one's engine flags (for a test that kills its engine)."""
    served = start_serve(
        model, "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL,
        "--api-key", API_KEY, *extra,
    )  # fmt: skip
    return served.process, served.base


@pytest.fixture(scope="module")
def server(smollm2_server: Served):  # type: ignore[no-untyped-def]
    """The run's shared SmolLM2 server (conftest.py): two API servers, an API key."""
    return {"base": smollm2_server.base, "process": smollm2_server.process}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream_and_stream_agree(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0
    assert response.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_http_greedy_equals_offline_api(client: openai.OpenAI, smollm2_gguf: str) -> None:
    from frontend import LLM, SamplingParams

    prompts = ["The three primary colors are", "def fibonacci(n):", "Paris is"]
    http = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=16).choices[0].text
        for p in prompts
    ]
    with LLM(smollm2_gguf, dtype="float32", max_model_len=1024) as llm:
        offline = [
            r.outputs[0].text for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        ]
    assert http == offline


def test_completions_n_stop_logprobs_echo(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        n=2,
        temperature=0.9,
        seed=3,
        max_tokens=30,
        stop=["."],
        logprobs=2,
        echo=True,
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.text.startswith("Once upon a time")
        assert "." not in choice.text
        assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(
            choice.logprobs.token_logprobs
        )
        # echo with logprobs: the prompt's tokens come first, the very first with no logprob
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert "".join(choice.logprobs.tokens).startswith("Once upon a time")
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
        offsets = choice.logprobs.text_offset
        assert offsets == [sum(len(t) for t in choice.logprobs.tokens[:i]) for i in range(len(offsets))]
    stream = list(
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True)
    )
    assert stream[-1].choices[0].finish_reason in ("length", "stop")
    # Token-id prompts are decoded for echo (and only then).
    ids = [504, 3458, 314, 2063]
    plain, echoed = (
        client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=echo)
        for echo in (False, True)
    )
    assert len(echoed.choices[0].text) > len(plain.choices[0].text) > 0
    assert echoed.choices[0].text.endswith(plain.choices[0].text)


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ({"messages": QUESTION, "temperature": -1}, 400, "temperature", None),
        ({"messages": QUESTION, "top_p": 2}, 400, "top_p", None),
        ({"messages": QUESTION, "max_tokens": 5000}, 400, "messages", "context_length_exceeded"),
        ({"messages": QUESTION, "model": "nope"}, 404, "model", "model_not_found"),
        ({"messages": "not a list"}, 400, "messages", None),
        ({"messages": []}, 400, "messages", None),
    ],
)
def test_errors_are_openai_shaped(server, body, status, param, code) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server['base']}/v1/chat/completions", json=body, headers=auth(), timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param and error["code"] == code and error["type"]


def test_context_length_message(server) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(
        f"{server['base']}/v1/completions",
        json={"prompt": [5] * 1000, "max_tokens": 100},
        headers=auth(),
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens (1000 in the messages, 100 in the completion)."
    )


def test_api_key_required(server) -> None:  # type: ignore[no-untyped-def]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            f"{server['base']}/v1/chat/completions", json={"messages": QUESTION}, headers=headers
        )
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server['base']}/health").status_code == 200


def test_both_api_servers_answer(server) -> None:  # type: ignore[no-untyped-def]
    seen = set()
    for _ in range(40):
        with httpx.Client() as fresh:  # a new connection each time: the kernel picks an acceptor
            response = fresh.get(f"{server['base']}/load", headers=auth())
            seen.add(response.headers["x-engine-server"])
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}, listeners_report(int(server["base"].rsplit(":", 1)[1]))


INVARIANCE_PROMPTS = [
    "The sky is",
    "Write one sentence about the sea:",
    "List three colors:",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "The capital of Italy is",
    "Once upon a time,",
    "2 + 2 =",
]


def test_greedy_is_the_same_alone_and_under_load_through_both_api_servers(server) -> None:  # type: ignore[no-untyped-def]
    """Batch-invariant greedy (docs/batch-invariance.md): each prompt alone, then all of them at once
    with long prompts prefilled between their steps, each on a fresh connection (the kernel spreads them
    over both API servers): the same text and the same logprobs, bit for bit."""

    def complete(prompt: str, max_tokens: int = 24) -> tuple[str, list[float], str]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=300) as fresh:
            response = fresh.post(f"{server['base']}/v1/completions", json=body, headers=auth())
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"], response.headers["x-engine-server"]

    alone = [complete(prompt)[:2] for prompt in INVARIANCE_PROMPTS]
    load = [" ".join(["word"] * 300 + [str(i)]) for i in range(6)]  # prefills of 300 tokens meanwhile
    with concurrent.futures.ThreadPoolExecutor(len(INVARIANCE_PROMPTS) + len(load)) as pool:
        busy = [pool.submit(complete, prompt, 8) for prompt in load]
        together = [pool.submit(complete, prompt) for prompt in INVARIANCE_PROMPTS]
        results = [future.result() for future in together]
        for future in busy:
            future.result()
    assert [result[:2] for result in results] == alone


def test_tokenize_detokenize(server) -> None:  # type: ignore[no-untyped-def]
    tokens = httpx.post(f"{server['base']}/tokenize", json={"prompt": "Hello world"}, headers=auth()).json()[
        "tokens"
    ]
    text = httpx.post(f"{server['base']}/detokenize", json={"tokens": tokens}, headers=auth()).json()[
        "prompt"
    ]
    assert text == "Hello world"


def engine_stats(server) -> dict:  # type: ignore[no-untyped-def]
    return httpx.get(f"{server['base']}/load", headers=auth()).json()["engine"]


@pytest.mark.parametrize("prompts", [["Tell me a long story."], ["Tell me a long story.", "And another."]])
def test_client_disconnect_mid_stream_frees_blocks(server, prompts: list[str]) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(timeout=60) as raw:
        body = {"prompt": prompts, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with raw.stream("POST", f"{server['base']}/v1/completions", json=body, headers=auth()) as response:
            for count, _ in enumerate(response.iter_lines()):
                if count > 5:
                    break  # leaving the block closes the connection mid-stream

    # 900 tokens take far longer than this to generate: only an abort frees the blocks in time.
    def freed() -> bool:  # None: this API server has had no stats from the engine yet
        stats = engine_stats(server)
        return stats is not None and stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0

    wait_until(freed, 8, "the aborted request's blocks to be freed")


def test_streamed_prompts_run_at_once(client: openai.OpenAI) -> None:
    # Several prompts in one streamed request are generated together, their chunks interleaved (as in
    # vLLM), not one prompt after the other; usage counts them all.
    prompts = [[504, 3458, 314, 2063], [2063, 314, 3458], [42, 4242]]
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    order = [c.choices[0].index for c in chunks if c.choices]
    assert set(order) == {0, 1, 2}
    first_of = {index: order.index(index) for index in (0, 1, 2)}
    last_of = {index: len(order) - 1 - order[::-1].index(index) for index in (0, 1, 2)}
    assert max(first_of.values()) < min(last_of.values()), order
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(c.index for c in finishes) == [0, 1, 2] and all(
        c.finish_reason == "length" for c in finishes
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 9 and chunks[-1].usage.completion_tokens == 36
    texts = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    for index, ids in enumerate(prompts):  # each the same as asked alone
        alone = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert texts[index] == alone.choices[0].text


def settled_steps(server) -> int:  # type: ignore[no-untyped-def]
    """The engine's step count once it is idle and both API servers report it: each keeps the stats the
    engine last sent it, refreshed for all by the idle heartbeat; reads on fresh connections reach both.
    Idle: nothing running or waiting in the engine, and no request open in either API server (an earlier
    test's aborted stream once ran 36 steps inside a count)."""
    seen: list[int] = []

    def agreed() -> bool:
        reads = [httpx.get(f"{server['base']}/load", headers=auth()).json() for _ in range(8)]
        idle = all(
            r["server_load"] == 0
            and r["engine"] is not None
            and r["engine"]["num_running"] == 0
            and r["engine"]["num_waiting"] == 0
            for r in reads
        )
        seen[:] = [r["engine"]["num_steps"] for r in reads] if idle else []
        return idle and len(set(seen)) == 1

    wait_until(agreed, 15, "both API servers to report the idle engine's steps")
    return seen[0]


def test_served_prompts_are_prefilled_in_short_steps(server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    # `engine serve` budgets 256 tokens a step (frontend.config.server_args.SERVE_MAX_NUM_BATCHED_TOKENS): a 700-token
    # prompt takes three prefill steps; with the offline budget of 2,048 it would take one.
    prompt = [1000 + (i * 37) % 20000 for i in range(700)]  # no other test's prefix: nothing cached
    before = settled_steps(server)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == 700 and completion.usage.completion_tokens == 1
    wait_until(lambda: settled_steps(server) > before, 15, "the engine's step count")
    assert settled_steps(server) - before == 3  # 256 + 256 + 188 prompt tokens, the last samples


def test_client_disconnect_before_a_non_streamed_answer_frees_blocks(server) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": ["Tell me a long story.", "And another one."], "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server['base']}/v1/completions", json=body, headers=auth(), timeout=2.0)
    wait_until(
        lambda: engine_stats(server)["num_running"] == 0 and engine_stats(server)["kv_cache_usage"] == 0.0,
        8,
        "the abandoned request's blocks to be freed",
    )


def test_multi_prompt_completion_batches_and_orders(client: openai.OpenAI) -> None:
    prompts = ["One, two, three,", "A, B, C,"]
    response = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: n copies agree
    singles = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6) for p in prompts]
    assert [response.choices[0].text, response.choices[2].text] == [r.choices[0].text for r in singles]
    # greedy: each prompt's two choices are its single answer twice over
    assert response.usage.completion_tokens == 2 * sum(r.usage.completion_tokens for r in singles)
    assert response.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in singles)


def test_chat_content_parts_continue_final_message_and_n_streams(client: openai.OpenAI) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    # the parts are joined with newlines (vLLM's rendering)
    joined = [{"role": "user", "content": "What is the capital \nof France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=joined, temperature=0, max_tokens=12)
    from_parts = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=12)
    assert from_parts.choices[0].message.content == plain.choices[0].message.content
    prefix = "The capital of France is"
    continued = client.chat.completions.create(
        model=MODEL,
        messages=[*QUESTION, {"role": "assistant", "content": prefix}],
        temperature=0,
        max_tokens=5,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "Paris" in continued.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, temperature=0.8, seed=1, max_tokens=10, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_stop_string_never_streams(client: openai.OpenAI) -> None:
    text = (
        client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=30)
        .choices[0]
        .text
    )
    stop = text.strip()[:3]
    assert stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=30, stop=[stop], stream=True
        )
        if c.choices
    )
    assert stop not in streamed and text.startswith(streamed)


def scrape(server) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Sample name (with labels) -> value, from whichever API server answers."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client() as fresh:
        text = fresh.get(f"{server['base']}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}"] = (
                values.get(f"{sample.name}{{{labels}}}", 0.0) + sample.value
            )
    return values


def total(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == name)


def test_metrics_sum_over_both_api_servers(server) -> None:  # type: ignore[no-untyped-def]
    before = scrape(server)
    prompt_tokens, count, servers = 0, 0, set()
    while count < 8 or (servers != {"0", "1"} and count < 40):
        with httpx.Client(timeout=60) as fresh:  # new connections, so both API servers take some
            response = fresh.post(
                f"{server['base']}/v1/completions",
                json={"prompt": f"Request number {count} says", "max_tokens": 4, "temperature": 0},
                headers=auth(),
            )
        servers.add(response.headers["x-engine-server"])
        prompt_tokens += response.json()["usage"]["prompt_tokens"]
        count += 1
    for _ in range(4):  # every API server reports the same sums
        after = scrape(server)
        assert (
            total(after, "engine:prompt_tokens_total") - total(before, "engine:prompt_tokens_total")
            == prompt_tokens
        )
        assert (
            total(after, "engine:request_success_total") - total(before, "engine:request_success_total")
            == count
        )
        assert (
            total(after, "engine:generation_tokens_total") - total(before, "engine:generation_tokens_total")
            == 4 * count
        )
        assert (
            total(after, "engine:time_to_first_token_seconds_count")
            - total(before, "engine:time_to_first_token_seconds_count")
            == count
        )
    assert servers == {"0", "1"}, listeners_report(int(server["base"].rsplit(":", 1)[1]))
    wait_until(
        lambda: (
            total(scrape(server), "engine:num_requests_running") == 0
            and total(scrape(server), "engine:num_requests_waiting") == 0
        ),
        10,
        "idle gauges",
    )
    hits = total(scrape(server), "engine:prefix_cache_hits_total")
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 8
    for _ in range(2):
        httpx.post(
            f"{server['base']}/v1/completions",
            json={"prompt": long_prompt, "max_tokens": 1},
            headers=auth(),
            timeout=60,
        )
    wait_until(
        lambda: total(scrape(server), "engine:prefix_cache_hits_total") > hits,
        10,
        "a prefix-cache hit in the counters",
    )
    final = scrape(server)
    metered_paths = {k for k in final if k.startswith("engine:http_requests_total")}
    assert any("path=/v1/completions" in k for k in metered_paths)
    assert not any(
        f"path={p}," in k
        for k in metered_paths
        for p in ("/metrics", "/health", "/ping", "/load", "/version")
    )
    names = {k.split("{")[0] for k in final}
    for expected in (
        "engine:kv_cache_usage_perc",
        "engine:prefix_cache_queries_total",
        "engine:num_preemptions_total",
        "engine:e2e_request_latency_seconds_bucket",
        "engine:inter_token_latency_seconds_count",
        "engine:request_queue_time_seconds_sum",
        "engine:request_prefill_time_seconds_sum",
        "engine:request_decode_time_seconds_sum",
        "engine:request_prompt_tokens_count",
        "engine:request_generation_tokens_count",
        "engine:engine_info",
        "engine:http_requests_total",
    ):
        assert expected in names, expected


def test_engine_chat_and_complete_clients(server) -> None:  # type: ignore[no-untyped-def]
    common = [
        "--url",
        f"{server['base']}/v1",
        "--api-key",
        API_KEY,
        "--temperature",
        "0",
        "--max-tokens",
        "20",
    ]
    chat = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "chat", *common],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    complete = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "complete", *common, "-q", "The capital of France is"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert complete.returncode == 0 and complete.stdout.strip(), complete.stderr


def test_request_id_is_echoed(server) -> None:  # type: ignore[no-untyped-def]
    response = httpx.get(f"{server['base']}/v1/models", headers={**auth(), "X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert httpx.get(f"{server['base']}/v1/models", headers=auth()).headers["x-request-id"]


def test_bench_serve_reports_every_request(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for extra in (
        ["--max-concurrency", "3"],
        ["--request-rate", "20", "--burstiness", "0.5", "--endpoint", "chat"],
    ):
        out = tmp_path / "bench.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "frontend.cli",
                "bench",
                "serve",
                "--base-url",
                server["base"],
                "--api-key",
                API_KEY,
                "--num-prompts",
                "6",
                "--input-len",
                "20",
                "--output-len",
                "8",
                "--ignore-eos",
                "--quiet",
                "--output-json",
                str(out),
                "--goodput",
                "ttft:60000",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert run.returncode in (0, 1), run.stderr
        summary = __import__("json").loads(out.read_text())["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
        assert summary["total_output_tokens"] == 48
        assert summary["ttft_s"]["p50"] > 0 and summary["e2el_s"]["p99"] >= summary["e2el_s"]["p50"]
        assert summary["goodput"] > 0
        assert "Output token throughput" in run.stdout


def engine_process(server) -> psutil.Process:  # type: ignore[no-untyped-def]
    return next(
        p
        for p in psutil.Process(server["process"].pid).children()
        if "engine_core.main" in " ".join(p.cmdline())
    )


def started_long_stream(client: openai.OpenAI):  # type: ignore[no-untyped-def]
    """A streamed 900-token completion whose first chunk has arrived."""
    stream = client.completions.create(
        model=MODEL,
        prompt="Count to a thousand:",
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    return stream


@pytest.fixture(scope="module")
def doomed(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    """A server of its own, two API servers that judge a silent engine gone after 2 s: the silent engine's
    test stops its engine and lets it go on, then the engine death's test kills it."""
    process, base = start_server(smollm2_gguf, "--api-server-count", "2", "--engine-heartbeat-timeout", "2")
    try:
        yield {"base": base, "process": process}
    finally:
        stop(process)


@pytest.fixture(scope="module")
def doomed_client(doomed) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{doomed['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_silent_engine_is_judged_dead_then_taken_back(doomed, doomed_client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP the engine past the heartbeat timeout: open requests fail and /health turns 503; once it
    runs again the API servers take requests again and abort the failed request (its blocks are freed
    long before its 900 tokens could have been generated)."""
    server, client = doomed, doomed_client
    engine = engine_process(server)
    stream = started_long_stream(client)
    engine.suspend()
    try:
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        wait_until(
            lambda: httpx.get(f"{server['base']}/health").status_code == 503, 30, "/health to report 503"
        )
    finally:
        engine.resume()
    healthy: set[str] = set()

    def both_healthy() -> bool:
        with httpx.Client() as fresh:  # a new connection each time: the kernel picks an acceptor
            response = fresh.get(f"{server['base']}/health")
        if response.status_code == 200:
            healthy.add(response.headers["x-engine-server"])
        return healthy == {"0", "1"}

    wait_until(both_healthy, 30, "both API servers' /health to be 200 again")
    wait_until(
        lambda: engine_stats(server)["num_running"] == 0 and engine_stats(server)["kv_cache_usage"] == 0.0,
        8,
        "the failed request to be aborted",
    )
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert answer.choices[0].finish_reason == "length"


def test_engine_death_fails_requests_and_health(doomed, doomed_client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    """It kills the engine: the last test of the doomed server."""
    engine_death_fails_requests_and_health(doomed, doomed_client)


def engine_death_fails_requests_and_health(server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    engine = engine_process(server)
    run_dir = engine.environ()["ENGINE_RUN_DIR"]
    assert any(name.startswith("w-") for name in os.listdir(run_dir))  # the workers' socket folder
    stream = started_long_stream(client)
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    wait_until(lambda: httpx.get(f"{server['base']}/health").status_code == 503, 40, "/health to report 503")
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert error.value.status_code == 503
    # Then the launcher stops everything and exits non-zero, so a supervisor restarts it.
    assert server["process"].wait(timeout=60) != 0
    assert not os.path.exists(run_dir), "the killed engine's folder (its workers' sockets) was left behind"
