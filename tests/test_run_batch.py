"""End to end, the batch paths on SmolLM2: `engine run-batch` over a 200-line file with invalid lines mixed
in (every line answered once, in order, the invalid ones as error records), its answers equal to a real
`engine serve`'s for the same greedy requests; and POST /v1/chat/completions/batch on that server, each
conversation's answer equal to its own /v1/chat/completions answer. Two engines start: the server's and
run-batch's."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from tests.serve_helpers import SHARED_API_KEY, SHARED_MODEL_NAME, Served

pytestmark = pytest.mark.slow

MODEL = SHARED_MODEL_NAME
AUTH = {"Authorization": f"Bearer {SHARED_API_KEY}"}
MAX_TOKENS = 4
COMMON = ["--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def base(smollm2_server: Served) -> str:
    """The run's shared SmolLM2 server (conftest.py), whose answers the batch's must equal."""
    return smollm2_server.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=SHARED_API_KEY, max_retries=0, timeout=120)


def chat_body(i: int) -> dict[str, Any]:
    content = f"Give me a word that rhymes with number {i}."
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def completion_body(i: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"Item {i}: the", "max_tokens": MAX_TOKENS, "temperature": 0}


def request_line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


# line index -> (its text, the custom_id its record carries, the error's code, the error's param)
INVALID = {
    7: ("{this is not json", None, "invalid_json", None),
    17: (json.dumps({"method": "POST", "url": "/v1/completions", "body": completion_body(17)}), None, "invalid_custom_id", "custom_id"),
    27: (request_line("bad-url", "/v1/nothing", completion_body(27)), "bad-url", "invalid_url", "url"),
    37: (request_line("bad-method", "/v1/completions", completion_body(37), "GET"), "bad-method", "invalid_method", "method"),
    47: (request_line("embed", "/v1/embeddings", {"model": MODEL, "input": "hi"}), "embed", "model_task_not_supported", "model"),  # a generative model's 404
    57: (request_line("audio", "/v1/chat/completions", {**chat_body(57), "audio": {"voice": "x"}}), "audio", "unsupported_field", "audio"),
    67: (request_line("no-model", "/v1/completions", {**completion_body(67), "model": "gpt-9"}), "no-model", "model_not_found", "model"),
    77: (request_line("stream", "/v1/completions", {**completion_body(77), "stream": True}), "stream", "unsupported_field", "body.stream"),
    87: (request_line("chat-11", "/v1/chat/completions", chat_body(11)), "chat-11", "duplicate_custom_id", "custom_id"),
    97: (request_line("no-body", "/v1/completions", None), "no-body", "invalid_body", "body"),  # type: ignore[arg-type]
    107: (request_line("too-long", "/v1/completions", {**completion_body(107), "max_tokens": 5000}), "too-long", "context_length_exceeded", "prompt"),
}  # fmt: skip


# conversations that run-batch answers one per line and the batch door answers in one request
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "Count to three."}],
]
CONVERSATION_LINES = {120: 0, 150: 1, 180: 2}  # line index -> conversation
RESPONSES_LINE = 130  # one line for the Responses door
RESPONSES_BODY = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": MAX_TOKENS, "temperature": 0}


def conversation_body(c: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": CONVERSATIONS[c], "max_tokens": MAX_TOKENS, "temperature": 0}


def batch_file() -> tuple[list[str], list[str | None]]:
    """200 lines: chat and completions requests, with the INVALID ones and the CONVERSATIONS in their
    places."""
    lines, custom_ids = [], []
    for i in range(200):
        if i in INVALID:
            text, custom_id, _, _ = INVALID[i]
        elif i in CONVERSATION_LINES:
            custom_id = f"conversation-{CONVERSATION_LINES[i]}"
            text = request_line(custom_id, "/v1/chat/completions", conversation_body(CONVERSATION_LINES[i]))
        elif i == RESPONSES_LINE:
            custom_id, text = "responses", request_line("responses", "/v1/responses", RESPONSES_BODY)
        elif i % 10 == 1:  # a chat prompt is ~8 times longer (the template's system turn): fewer of them
            custom_id, text = f"chat-{i}", request_line(f"chat-{i}", "/v1/chat/completions", chat_body(i))
        else:
            custom_id, text = f"cmpl-{i}", request_line(f"cmpl-{i}", "/v1/completions", completion_body(i))
        lines.append(text)
        custom_ids.append(custom_id)
    return lines, custom_ids


@pytest.fixture(scope="module")
def records(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 200-line file through the real `engine run-batch` (it stops its engine before returning)."""
    lines, _ = batch_file()
    folder = tmp_path_factory.mktemp("run-batch")
    source, target = folder / "requests.jsonl", folder / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [
        sys.executable,
        "-m",
        "frontend.cli",
        "run-batch",
        smollm2_gguf,
        *COMMON,
        "-i",
        str(source),
        "-o",
        str(target),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"200 lines, {200 - len(INVALID)} answered, {len(INVALID)} errors" in done.stderr
    return [json.loads(text) for text in target.read_text().splitlines()]


def test_run_batch_answers_every_line_once_in_order(records: list[dict[str, Any]]) -> None:
    lines, custom_ids = batch_file()
    assert [r["custom_id"] for r in records] == custom_ids
    assert len({r["id"] for r in records}) == 200
    for i, record in enumerate(records):
        if i in INVALID:
            _, _, code, param = INVALID[i]
            assert record["error"] is not None, i
            assert (record["error"]["code"], record["error"]["param"]) == (code, param), record
            if record["response"] is not None:  # the door's own answer: a 4xx in its body
                assert record["response"]["status_code"] in (400, 404)
                assert record["response"]["body"]["error"] == record["error"]
            continue
        assert record["error"] is None, record
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        url = json.loads(lines[i])["url"]
        if url == "/v1/responses":
            assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
            assert 0 < body["usage"]["output_tokens"] <= MAX_TOKENS
            continue
        assert body["object"] == ("text_completion" if url == "/v1/completions" else "chat.completion")
        assert 0 < body["usage"]["completion_tokens"] <= MAX_TOKENS


def test_run_batch_answers_equal_the_http_servers(
    records: list[dict[str, Any]], client: openai.OpenAI
) -> None:
    """The same greedy requests over HTTP (sent together, so the server batches them too)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(client.chat.completions.create, **chat_body(1))
        completion = pool.submit(client.completions.create, **completion_body(2))
        over_http = chat.result().choices[0].message.content, completion.result().choices[0].text
    from_file = (
        records[1]["response"]["body"]["choices"][0]["message"]["content"],
        records[2]["response"]["body"]["choices"][0]["text"],
    )
    assert from_file == over_http and all(over_http)


def test_chat_batch_answers_equal_one_chat_request_each(base: str, records: list[dict[str, Any]]) -> None:
    """Each conversation's answer equals its own /v1/chat/completions answer (a run-batch line, which
    test_run_batch_answers_equal_the_http_servers ties to the server's)."""
    body = {
        "model": MODEL,
        "messages": CONVERSATIONS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{base}/v1/chat/completions/batch", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    singles = [records[i]["response"]["body"] for i in CONVERSATION_LINES]
    for choice, single in zip(batch["choices"], singles, strict=True):
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
        assert len(choice["prompt_token_ids"]) == single["usage"]["prompt_tokens"]
    for field in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][field] == sum(s["usage"][field] for s in singles)


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"stream": True}, "stream", "stream"),
        ({"n": 2}, "n", "n = 1"),
        ({"messages": CONVERSATIONS[0]}, "messages", "valid list"),
        ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": [{"type": "image_url"}]}]]},
         "messages[1][0].content[0].image_url", "messages[1]: an image_url part needs"),
        ({"audio": {"voice": "x"}}, "audio", "audio"),
    ],
)  # fmt: skip
def test_chat_batch_rejects_with_a_400_naming_the_field(
    base: str, change: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": MODEL, "messages": CONVERSATIONS, "max_tokens": 4, **change}
    response = httpx.post(f"{base}/v1/chat/completions/batch", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
