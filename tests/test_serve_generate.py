"""Tokens in, tokens out (`POST /inference/v1/generate`, vLLM's GenerateRequest) on the shared SmolLM2 server
(two API servers): its tokens and logprobs equal /v1/completions' for the same ids and parameters, greedy and
seeded, whole and streamed, in both output modes; max_tokens defaults to the rest of the context; a field we
do not implement is a 400 naming it; abort_requests ends a request another API server may own. And a
--tokens-only server: no tokenizer, only the generate doors."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.serve_helpers import SHARED_API_KEY, SHARED_MODEL_NAME, serving

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {SHARED_API_KEY}"}
PROMPT = [1, 504, 3458, 314, 253, 3875]


def generate(server, **body: Any) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{server.base}/inference/v1/generate", json=body, headers=HEADERS, timeout=60)


def completions(server, **body: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    answer = httpx.post(f"{server.base}/v1/completions", json={"prompt": PROMPT, "return_token_ids": True, **body},
                        headers=HEADERS, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def stream_chunks(server, **body: Any) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    chunks = []
    with httpx.stream("POST", f"{server.base}/inference/v1/generate", json={**body, "stream": True},
                      headers=HEADERS, timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


SAMPLINGS = {
    "greedy": dict(temperature=0, max_tokens=8, logprobs=3),
    "seeded_n2": dict(temperature=0.9, top_k=40, seed=7, n=2, max_tokens=6, stop_token_ids=[2]),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_generate_equals_completions(smollm2_server, name: str) -> None:  # type: ignore[no-untyped-def]
    params = SAMPLINGS[name]
    want = completions(smollm2_server, **params)
    got = generate(smollm2_server, token_ids=PROMPT, sampling_params=params).json()
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want["choices"]]
    assert got["request_id"].startswith("generate-tokens-") and got["output_mode"] == "tokens"
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    if params.get("logprobs"):
        content = got["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in content] == want["choices"][0]["logprobs"]["token_logprobs"]
        assert all(
            e["top_logprobs"][0]["token_id"] == e["token_id"] and len(e["top_logprobs"]) == 3 for e in content
        )
    streamed: dict[int, list[int]] = {}
    chunks = stream_chunks(smollm2_server, token_ids=PROMPT, sampling_params=params, return_token_ids=True,
                           stream_options={"include_usage": True})  # fmt: skip
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert [streamed[i] for i in sorted(streamed)] == [c["token_ids"] for c in got["choices"]]
    assert chunks[0]["prompt_token_ids"] == PROMPT and "prompt_token_ids" not in chunks[1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == got["usage"]


def test_text_mode_and_the_context_default(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    want = completions(smollm2_server, temperature=0, max_tokens=6)
    got = generate(
        smollm2_server,
        token_ids=PROMPT,
        output_mode="text",
        sampling_params={"temperature": 0, "max_tokens": 6},
    )
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    chunks = stream_chunks(smollm2_server, token_ids=PROMPT, output_mode="text",
                           sampling_params={"temperature": 0, "max_tokens": 6})  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["choices"][0]["text"]
    limit = httpx.get(f"{smollm2_server.base}/v1/models", headers=HEADERS, timeout=10).json()["data"][0][
        "max_model_len"
    ]
    long_prompt = PROMPT * ((limit - 3) // len(PROMPT)) + PROMPT[: (limit - 3) % len(PROMPT)]
    answer = generate(
        smollm2_server, token_ids=long_prompt, sampling_params={"temperature": 0, "ignore_eos": True}
    )
    choice = answer.json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"  # the rest of the context


def test_what_we_do_not_implement_is_refused_by_name(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    defaults = {
        "output_kind": 2,
        "skip_clone": True,
        "flat_logprobs": False,
        "extra_args": None,
        "detokenize": True,
    }
    assert (
        generate(smollm2_server, token_ids=PROMPT, sampling_params={"max_tokens": 2, **defaults}).status_code
        == 200
    )
    cases = {
        "sampling_params.flat_logprobs": dict(sampling_params={"flat_logprobs": True}),
        "sampling_params.bogus": dict(sampling_params={"bogus": 1}),
        "sampling_params.temperature": dict(sampling_params={"temperature": "hot"}),
        "kv_transfer_params": dict(sampling_params={}, kv_transfer_params={"do_remote_decode": True}),
        "features": dict(sampling_params={}, features={"mm_hashes": {}}),
        "token_ids": dict(sampling_params={}, token_ids=[1, -2]),
        "sampling_params.stop": dict(sampling_params={"stop": ["x"], "detokenize": False}),
        "output_mode": dict(sampling_params={"detokenize": False}, output_mode="text"),
    }
    for param, body in cases.items():
        answer = generate(smollm2_server, **{"token_ids": PROMPT, **body})
        assert answer.status_code == 400, (param, answer.text)
        assert answer.json()["error"]["param"] == param, answer.json()


def test_abort_requests_ends_a_request(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    chunks: list[dict[str, Any]] = []
    started = threading.Event()

    def run() -> None:
        body = {"token_ids": PROMPT, "request_id": "abort-me", "stream": True,
                "sampling_params": {"max_tokens": 900, "ignore_eos": True, "temperature": 0}}  # fmt: skip
        with httpx.stream("POST", f"{smollm2_server.base}/inference/v1/generate", json=body, headers=HEADERS,
                          timeout=120) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    answer = httpx.post(f"{smollm2_server.base}/inference/v1/abort_requests",
                        json={"request_ids": ["generate-tokens-abort-me"]}, headers=HEADERS, timeout=10)  # fmt: skip
    assert answer.status_code == 200
    thread.join(60)
    assert not thread.is_alive()
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 900


def test_a_tokens_only_server(smollm2_gguf: str) -> None:
    flags = [
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--tokens-only",
        "--served-model-name",
        SHARED_MODEL_NAME,
    ]
    with serving(smollm2_gguf, *flags) as server:
        base = server.base
        answer = httpx.post(f"{base}/inference/v1/generate", timeout=60,
                            json={"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 4}})  # fmt: skip
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 4
        for body, param in [
            ({"output_mode": "text"}, "output_mode"),
            ({"sampling_params": {"stop": ["."]}}, "sampling_params.stop"),
        ]:
            refused = httpx.post(f"{base}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {},
                                                                         **body}, timeout=30)  # fmt: skip
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        assert (
            httpx.post(f"{base}/abort_requests", json={"request_ids": ["none"]}, timeout=10).status_code
            == 200
        )
        chat = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
        )
        assert chat.status_code == 404
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200
        assert httpx.get(f"{base}/tokenizer_info", timeout=10).status_code == 404  # without its flag
        tokenize = httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, timeout=10)
        assert tokenize.status_code == 400 and "no tokenizer" in tokenize.json()["error"]["message"]


def post(server, path: str, body: dict[str, Any]) -> Any:  # type: ignore[no-untyped-def]
    answer = httpx.post(f"{server.base}{path}", json=body, headers=HEADERS, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


CHATS = {
    "greedy_logprobs": dict(temperature=0, max_tokens=8, logprobs=True, top_logprobs=2),
    "seeded_n2": dict(temperature=0.8, seed=11, n=2, max_tokens=6),
    "json_schema": dict(temperature=0, max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
            "n": {"type": "integer"}}, "required": ["n"]}}}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CHATS))
def test_render_then_generate_equals_the_chat_door(smollm2_server, name: str) -> None:  # type: ignore[no-untyped-def]
    chat = {"model": SHARED_MODEL_NAME, "messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Count to three."}], **CHATS[name]}  # fmt: skip
    want = post(smollm2_server, "/v1/chat/completions", {**chat, "return_token_ids": True})
    rendered = post(smollm2_server, "/v1/chat/completions/render", chat)
    assert rendered["token_ids"] == want["prompt_token_ids"] and rendered["request_id"].startswith(
        "chatcmpl-"
    )
    got = post(smollm2_server, "/inference/v1/generate", rendered)
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]
    if name == "greedy_logprobs":
        assert [e["logprob"] for e in got["choices"][0]["logprobs"]["content"]] == [
            e["logprob"] for e in want["choices"][0]["logprobs"]["content"]
        ]


def test_render_completions_then_generate(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": SHARED_MODEL_NAME, "prompt": ["The sky is", "Two and two make"], "temperature": 0,
            "max_tokens": 5}  # fmt: skip
    want = post(smollm2_server, "/v1/completions", {**body, "return_token_ids": True})
    rendered = post(smollm2_server, "/v1/completions/render", body)
    assert [r["request_id"][-2:] for r in rendered] == ["-0", "-1"]
    for p, request in enumerate(rendered):
        assert request["token_ids"] == want["choices"][p]["prompt_token_ids"]
        got = post(smollm2_server, "/inference/v1/generate", request)
        assert got["choices"][0]["token_ids"] == want["choices"][p]["token_ids"]


DERENDER_CHATS = {
    **CHATS,
    "stop_string": dict(temperature=0, max_tokens=16, stop=["three", "3"]),
    "logprobs_past_the_top": dict(temperature=1.0, seed=3, max_tokens=8, logprobs=True, top_logprobs=1),
}


@pytest.mark.parametrize("name", list(DERENDER_CHATS))
def test_render_generate_derender_equals_the_chat_door(smollm2_server, name: str) -> None:  # type: ignore[no-untyped-def]
    chat = {"model": SHARED_MODEL_NAME, "messages": [{"role": "user", "content": "Count to three."}],
            **DERENDER_CHATS[name]}  # fmt: skip
    want = post(smollm2_server, "/v1/chat/completions", chat)
    rendered = post(smollm2_server, "/v1/chat/completions/render", chat)
    generated = post(smollm2_server, "/inference/v1/generate", rendered)
    got = post(smollm2_server, "/v1/chat/completions/derender", {
        "generate_response": generated, "prompt_token_ids": rendered["token_ids"],
        "prompt_tokens": len(rendered["token_ids"]), "chat_request": chat})  # fmt: skip
    assert got["id"] == rendered["request_id"] and got["object"] == "chat.completion"
    assert (
        got["choices"] == want["choices"]
        and got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    )
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def test_render_generate_derender_completions(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": SHARED_MODEL_NAME, "prompt": ["The sky is", "Two and two make"], "temperature": 0,
            "max_tokens": 6, "logprobs": 2, "stop": [" blue"]}  # fmt: skip
    want = post(smollm2_server, "/v1/completions", body)
    rendered = post(smollm2_server, "/v1/completions/render", body)
    generated = [post(smollm2_server, "/inference/v1/generate", request) for request in rendered]
    got = post(smollm2_server, "/v1/completions/derender", {"generate_responses": generated,
                                                            "completion_request": body})  # fmt: skip
    assert got["choices"] == want["choices"]
    assert got["usage"] == want["usage"]


def sse(server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    with httpx.stream("POST", f"{server.base}{path}", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
STREAMED = {
    "chat": {"messages": [{"role": "user", "content": "Count to three."}], "logprobs": True, "top_logprobs": 1},
    "chat_tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER,
                   "tool_choice": "required"},
    "completions": {"prompt": "One, two,", "logprobs": 2},
}  # fmt: skip


def streamed_answer(
    chunks: list[dict[str, Any]],
) -> tuple[str, list[tuple[str, str]], list[str], list[float]]:
    """A stream's text, its calls (name, arguments), finish reasons and logprobs, as a client assembles them."""
    text, calls, finishes, logprobs = "", {}, [], []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            text += (delta.get("content") or "") if "delta" in choice else choice["text"]
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (
                    call["function"].get("name") or name,
                    arguments + call["function"]["arguments"],
                )
            finishes += [choice["finish_reason"]] if choice.get("finish_reason") else []
            logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
            if "text" in choice and choice["logprobs"]:  # completions: each token's logprob and text offset
                logprobs += [*choice["logprobs"]["token_logprobs"], *choice["logprobs"]["text_offset"]]
    return text, [calls[i] for i in sorted(calls)], finishes, logprobs


@pytest.mark.parametrize("name", list(STREAMED))
def test_streamed_derender_chunk_by_chunk_equals_the_door_streamed(smollm2_server, name: str) -> None:  # type: ignore[no-untyped-def]
    """vLLM's stateless streamed derender: one call per generate chunk, the client carrying stream_state;
    the text (a stop string's held-back prefix included), tool calls (read by the door's parser), finish
    reasons, usage and logprobs are the door's own stream's."""
    body = {"model": SHARED_MODEL_NAME, "temperature": 0, "max_tokens": 16 if name != "chat_tools" else 40,
            "stream": True, "stream_options": {"include_usage": True}, **STREAMED[name]}  # fmt: skip
    if name != "chat_tools":
        body["stop"] = ["three", "3"]
    path, door = (
        ("/v1/completions", "completion") if name == "completions" else ("/v1/chat/completions", "chat")
    )
    want = sse(smollm2_server, path, body)
    rendered = post(smollm2_server, path + "/render", body)
    rendered = rendered[0] if door == "completion" else rendered
    state, got = None, []
    for chunk in sse(smollm2_server, "/inference/v1/generate", rendered):
        answer = post(smollm2_server, path + "/derender", {"stream": True, "generate_chunk": chunk, "stream_state": state,
                      "prompt_tokens": len(rendered["token_ids"]), f"{door}_request": body})  # fmt: skip
        got.append(answer["chunk"])
        state = answer["stream_state"]
    text, calls, finishes, logprobs = streamed_answer(got)
    assert (text, calls, finishes, logprobs) == streamed_answer(want) and (text or calls)
    assert got[-1]["usage"]["completion_tokens"] == want[-1]["usage"]["completion_tokens"]
    if door == "chat":  # the role once, in the first chunk (stream_state.role_sent)
        assert [x["choices"][0]["delta"].get("role") for x in got if x["choices"]][:2] == ["assistant", None]
    if name != "chat_tools":
        assert logprobs
    if name == "chat_tools":
        assert calls and calls[0][0] == "get_weather" and finishes == ["tool_calls"]
        assert len(state["last_tool_call_ids"]) == len(calls)


def test_derender_refuses_what_it_cannot_read(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    generated = post(
        smollm2_server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    )
    for body, param in [
        ({"generate_response": generated}, "chat_request"),
        (
            {"generate_response": {**generated, "output_mode": "text"}, "chat_request": chat},
            "generate_response",
        ),
        ({"generate_response": generated, "chat_request": {**chat, "n": 2}}, "generate_response"),
    ]:
        answer = httpx.post(
            f"{smollm2_server.base}/v1/chat/completions/derender", json=body, headers=HEADERS, timeout=30
        )
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def label_logprob(server, prompt: list[int], label: int) -> float:  # type: ignore[no-untyped-def]
    """log P(label | prompt) from a direct forward pass: the prompt logprobs of prompt + [label]."""
    answer = post(
        server, "/v1/completions", {"prompt": prompt + [label], "max_tokens": 1, "prompt_logprobs": 0}
    )
    return float(answer["choices"][0]["prompt_logprobs"][-1][str(label)]["logprob"])


def test_generative_scoring_equals_a_forward_pass(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    import math

    tokens = post(smollm2_server, "/tokenize", {"prompt": " yes no", "add_special_tokens": False})["tokens"]
    labels = tokens[:2]
    query = post(smollm2_server, "/tokenize", {"prompt": "Is the sky blue? Answer:"})["tokens"]
    items = [[253, 3875], [504, 3458, 314]]
    for apply_softmax, item_first in [(True, False), (False, True)]:
        got = post(smollm2_server, "/generative_scoring", {"query": query, "items": items, "label_token_ids": labels,
                                                           "apply_softmax": apply_softmax, "item_first": item_first})  # fmt: skip
        assert got["object"] == "list" and [d["index"] for d in got["data"]] == [0, 1]
        for item, entry in zip(items, got["data"], strict=True):
            prompt = item + query if item_first else query + item
            values = [label_logprob(smollm2_server, prompt, label) for label in labels]
            want = math.exp(values[0]) / sum(map(math.exp, values)) if apply_softmax else math.exp(values[0])
            assert entry["score"] == pytest.approx(want, rel=1e-4)
    # the generate door's sampling_params.logprob_token_ids: exactly those tokens' logprobs, ranks unknown
    answer = post(smollm2_server, "/inference/v1/generate", {
        "token_ids": query, "sampling_params": {"max_tokens": 1, "temperature": 0, "logprob_token_ids": labels}})  # fmt: skip
    content = answer["choices"][0]["logprobs"]["content"][0]
    listed = [e["token_id"] for e in content["top_logprobs"]]
    assert listed[0] == content["token_id"] and set(labels) <= set(listed)
    for entry in content["top_logprobs"]:
        if entry["token_id"] in labels:
            assert entry["logprob"] == pytest.approx(
                label_logprob(smollm2_server, query, entry["token_id"]), rel=1e-4
            )
    refused = generate(
        smollm2_server, token_ids=query, sampling_params={"logprob_token_ids": labels, "logprobs": 5}
    )
    assert (
        refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params.logprob_token_ids"
    )
    bad = httpx.post(f"{smollm2_server.base}/generative_scoring", json={"query": query, "items": items,
                     "label_token_ids": [10**7]}, headers=HEADERS, timeout=30)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "label_token_ids"


def test_a_render_server_without_an_engine(smollm2_server, smollm2_gguf: str) -> None:  # type: ignore[no-untyped-def]
    """`engine launch render`: the render doors from the tokenizer and the model's files alone; what it renders
    is what the full server renders, and a generate server turns it into the chat door's tokens."""
    import subprocess
    import sys

    from tests.serve_helpers import free_port, stop, wait_until

    port = free_port()
    command = [sys.executable, "-m", "frontend.cli", "launch", "render", smollm2_gguf, "--port", str(port),
               "--served-model-name", SHARED_MODEL_NAME, "--max-model-len", "1024"]  # fmt: skip
    process = subprocess.Popen(command)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 120, "the render server")
        chat = {"model": SHARED_MODEL_NAME, "messages": [{"role": "user", "content": "Count to three."}],
                "temperature": 0, "max_tokens": 8}  # fmt: skip
        rendered = httpx.post(f"{base}/v1/chat/completions/render", json=chat, timeout=30).json()
        full = post(smollm2_server, "/v1/chat/completions/render", chat)
        assert (rendered["token_ids"], rendered["sampling_params"]) == (
            full["token_ids"],
            full["sampling_params"],
        )
        want = post(smollm2_server, "/v1/chat/completions", {**chat, "return_token_ids": True})
        got = post(smollm2_server, "/inference/v1/generate", rendered)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=10).status_code == 404
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 1024
        assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, timeout=10).json()["count"] > 0
    finally:
        stop(process)
    assert process.returncode is not None
