"""`engine run-batch` without a model: the line checks, the output records, and the runner over a small
ASGI app of our own (answers out of order, a 400, an app that raises), so order, concurrency and
per-line errors are checked in milliseconds; and the batch door's per-conversation request.
tests/test_run_batch.py runs the real thing."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import pytest

from frontend.batch.asgi import call_app
from frontend.batch.cli import add_run_batch_parser
from frontend.batch.lines import LineError, answered, parse_line
from frontend.batch.runner import run_batch
from frontend.config.batch_args import BatchArgs
from frontend.config.flags import from_namespace
from frontend.server.errors import OpenAIError


def line(custom_id: Any = "a", **extra: Any) -> str:
    record = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    return json.dumps({**record, **extra})


@pytest.mark.parametrize(
    ("text", "code", "param", "custom_id"),
    [
        ("{not json", "invalid_json", None, None),
        ("[1, 2]", "invalid_line", None, None),
        (
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
            "invalid_custom_id",
            "custom_id",
            None,
        ),
        (line(7), "invalid_custom_id", "custom_id", None),
        (line(method="GET"), "invalid_method", "method", "a"),
        (line(url="/v1/nothing"), "invalid_url", "url", "a"),
        (line(url="/v1/moderations"), "unsupported_url", "url", "a"),
        (line(body="prompt"), "invalid_body", "body", "a"),
        (line(body={"prompt": "x", "stream": True}), "unsupported_field", "body.stream", "a"),
    ],
)
def test_a_bad_line_names_what_is_wrong(
    text: str, code: str, param: str | None, custom_id: str | None
) -> None:
    with pytest.raises(LineError) as caught:
        parse_line(text, 3)
    error = caught.value
    assert (error.code, error.param, error.custom_id) == (code, param, custom_id)
    assert error.message.startswith("line 3")
    assert error.error()["type"] == "invalid_request_error"


def test_moderations_are_named_as_not_supported_yet() -> None:
    with pytest.raises(LineError, match="moderations"):
        parse_line(line(url="/v1/moderations"), 1)


def test_pooling_lines_go_to_their_doors() -> None:
    for url in ("/v1/embeddings", "/v1/score", "/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert parse_line(line(url=url, body={"input": "x"}), 1).url == url


def test_a_good_line_keeps_its_body_and_method_case() -> None:
    parsed = parse_line(line("id-1", method="post", body={"prompt": "hi", "max_tokens": 3}), 1)
    assert (parsed.custom_id, parsed.url) == ("id-1", "/v1/completions")
    assert json.loads(parsed.body) == {"prompt": "hi", "max_tokens": 3}


def test_records_carry_the_door_answer_and_its_error() -> None:
    ok = answered("a", 200, "rid", b'{"id": "cmpl-1"}')
    assert ok["response"] == {"status_code": 200, "request_id": "rid", "body": {"id": "cmpl-1"}}
    assert ok["error"] is None and ok["id"].startswith("batch_req_")
    error_body = {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    bad = answered("b", 400, "rid2", json.dumps(error_body).encode())
    assert bad["response"]["body"] == error_body and bad["error"] == error_body["error"]


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers {"prompt": ...} after a delay that makes later lines finish first; 400 for "bad"; raises
    for "boom" before answering."""
    body = json.loads((await receive())["body"])
    echo_app.open += 1  # type: ignore[attr-defined]
    echo_app.peak = max(echo_app.peak, echo_app.open)  # type: ignore[attr-defined]
    try:
        await asyncio.sleep(body.get("delay", 0))
        if body["prompt"] == "boom":
            raise RuntimeError("boom")
        status = 400 if body["prompt"] == "bad" else 200
        payload = json.dumps({"error": {"message": "no", "type": "x", "param": "prompt", "code": None}})
        answer = payload if status == 400 else json.dumps({"prompt": body["prompt"], "path": scope["path"]})
    finally:
        echo_app.open -= 1  # type: ignore[attr-defined]
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"r-1")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.encode()})


def test_the_runner_keeps_order_answers_every_line_and_bounds_concurrency(tmp_path: pathlib.Path) -> None:
    lines = []
    for i in range(30):
        body = {"prompt": f"p{i}", "delay": (30 - i) * 0.002}
        lines.append(
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
        )
    lines[5] = "{broken"
    lines[9] = lines[9].replace('"p9"', '"bad"')
    lines[12] = lines[12].replace('"p12"', '"boom"')
    lines[20] = lines[3]  # a repeated custom_id
    lines.insert(15, "   ")  # blank lines are not requests
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    echo_app.open = echo_app.peak = 0  # type: ignore[attr-defined]
    summary = asyncio.run(run_batch(echo_app, str(source), str(target), 4, progress=False))
    records = [json.loads(text) for text in target.read_text().splitlines()]
    assert len(records) == summary.num_lines == 30
    assert 1 < echo_app.peak <= 4  # type: ignore[attr-defined]
    assert (summary.num_ok, summary.num_errors) == (26, 4)
    for i, record in enumerate(records):
        if i == 5:
            assert record["custom_id"] is None and record["error"]["code"] == "invalid_json"
        elif i == 9:
            assert record["response"]["status_code"] == 400 and record["error"]["param"] == "prompt"
        elif i == 12:
            assert record["response"] is None and record["error"]["type"] == "internal_error"
        elif i == 20:
            assert record["custom_id"] == "c3" and record["error"]["code"] == "duplicate_custom_id"
        else:
            assert record["custom_id"] == f"c{i}" and record["error"] is None
            assert record["response"]["body"] == {"prompt": f"p{i}", "path": "/v1/completions"}
            assert record["response"]["request_id"] == "r-1"


def test_call_app_hands_back_a_500_the_app_sent_before_raising() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {}}'})
        raise RuntimeError("after the answer")

    response = asyncio.run(call_app(app, "POST", "/v1/completions", b"{}"))
    assert (response.status, response.body, response.complete) == (500, b'{"error": {}}', True)


def parse(argv: list[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    add_run_batch_parser(parser.add_subparsers())
    return parser.parse_args(["run-batch", *argv])


def test_the_flags_are_the_engines_the_answer_shaping_server_ones_and_the_batch_ones() -> None:
    args = parse(
        ["model.gguf", "-i", "in.jsonl", "-o", "out.jsonl", "--max-num-seqs", "8", "--chat-template", "t"]
    )
    batch = from_namespace(BatchArgs, args)
    assert (args.model, args.chat_template, batch.input_file, batch.output_file) == (
        "model.gguf",
        "t",
        "in.jsonl",
        "out.jsonl",
    )
    assert batch.concurrency(args.max_num_seqs) == 16 and batch.progress_bar
    assert not hasattr(args, "port") and not hasattr(args, "api_server_count")
    with pytest.raises(SystemExit):
        parse(["-i", "a", "-o", "b", "--port", "8000"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "out"], "--input-file"),
        (["-i", "same", "-o", "same"], "must not be the input"),
        (["-i", "https://x/in", "-o", "out"], "local paths"),
        (["-i", "in", "-o", "out", "--max-concurrency", "0"], "at least 1"),
    ],
)
def test_bad_batch_flags_are_clear_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_namespace(BatchArgs, parse(argv))


def test_a_batch_conversation_is_the_chat_request_the_caller_would_have_sent() -> None:
    from frontend.openai.chat_batch import BatchChatCompletionRequest

    conversations = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    body = BatchChatCompletionRequest.model_validate(
        {"messages": conversations, "max_tokens": 3, "audio": {}}
    )
    second = body.conversation(1)
    assert second.messages == conversations[1] and second.max_tokens == 3
    # unset stays unset (generation-config defaults apply per conversation), extras reach check_supported
    assert second.model_fields_set == {"messages", "max_tokens", "audio"}
    with pytest.raises(OpenAIError) as caught:
        second.check_supported()
    assert caught.value.param == "audio"
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\].role"):
        BatchChatCompletionRequest.model_validate({"messages": [conversations[0], [{"role": "bot"}]]})
