"""End to end: the Responses API and Anthropic's Messages API on a real `engine serve` (two API servers,
SmolLM2, the hermes tool parser), driven by the official `openai` and `anthropic` SDKs: the same greedy
conversation gives the same text through chat completions, responses and messages; streams equal their
non-streamed answers; tools, structured output, a two-turn previous_response_id conversation across
both API servers, cancel, and each door's errors in its own shape (counted in the HTTP metrics)."""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serve_helpers import listeners_report, wait_until
from tests.test_serve_e2e import API_KEY, MODEL, scrape, start_server, stop

pytestmark = pytest.mark.slow

TEMPLATE = pathlib.Path(__file__).parent / "templates" / "hermes_tools.jinja"
QUESTION = "What is the capital of France?"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    process, base = start_server(
        smollm2_gguf,
        "--api-server-count", "2",
        "--chat-template", str(TEMPLATE),
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    )  # fmt: skip
    try:
        yield base
    finally:
        stop(process)


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oa(server: str) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def an(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)


GREEDY = {"temperature": 0}


def test_one_conversation_gives_one_text_through_every_door(
    oa: openai.OpenAI, an: anthropic.Anthropic
) -> None:
    system, turns = "You are brief.", [{"role": "user", "content": QUESTION}]
    chat = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, *turns], max_tokens=24, temperature=0
    )
    text = chat.choices[0].message.content
    assert text
    response = oa.responses.create(
        model=MODEL, instructions=system, input=QUESTION, max_output_tokens=24, temperature=0
    )
    message = an.messages.create(
        model=MODEL,
        system=system,
        messages=turns,
        max_tokens=24,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert response.output_text == text
    assert message.content[0].type == "text" and message.content[0].text == text
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert (
        message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    )
    assert response.usage.output_tokens == message.usage.output_tokens == chat.usage.completion_tokens


def test_messages_stream_and_count_tokens(an: anthropic.Anthropic) -> None:
    turns: Any = [{"role": "user", "content": QUESTION}]
    full = an.messages.create(model=MODEL, messages=turns, max_tokens=6, extra_body=GREEDY)
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 6
    kinds, deltas = [], ""
    with an.messages.stream(model=MODEL, messages=turns, max_tokens=6, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                deltas += event.delta.text
        final_text = stream.get_final_text()
        final = stream.get_final_message()
    assert deltas == final_text == full.content[0].text  # type: ignore[union-attr]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    counted = an.messages.count_tokens(model=MODEL, messages=turns)
    assert counted.input_tokens == full.usage.input_tokens + (full.usage.cache_read_input_tokens or 0)
    stopped = an.messages.create(
        model=MODEL, messages=turns, max_tokens=24, stop_sequences=[" Paris"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " Paris"


def test_messages_tool_use_and_result(an: anthropic.Anthropic) -> None:
    tool: Any = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
    }
    turns: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = an.messages.create(
        model=MODEL,
        messages=turns,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=40,
        extra_body=GREEDY,
    )
    use = forced.content[-1]
    assert forced.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    with an.messages.stream(
        model=MODEL, messages=turns, tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=40, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.content[-1].type == "tool_use" and streamed.content[-1].input == use.input
    answer = an.messages.create(
        model=MODEL,
        tools=[tool],
        messages=[
            *turns,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
            },
        ],
        tool_choice={"type": "none"},
        max_tokens=24,
        extra_body=GREEDY,
    )
    assert (
        answer.content
        and answer.content[0].type == "text"
        and answer.stop_reason in ("end_turn", "max_tokens")
    )


# One shot of text, a call and text again, which SmolLM2 copies for Rome (any text after a call would do).
SHOT = (
    'Checking Paris. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done.'
)
AROUND_A_CALL: Any = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": SHOT},
    {"role": "user", "content": "Weather in Rome?"},
]


def test_text_after_a_call_is_a_block_of_its_own_streamed_or_not(
    oa: openai.OpenAI, an: anthropic.Anthropic
) -> None:
    """Anthropic's content and Responses' output list what the model wrote in its order, streamed or not:
    the stream cannot reopen the text block it closed for the call, so the whole answer does not join the
    text around the call either."""
    tool: Any = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
    }
    ask: Any = {
        "model": MODEL,
        "messages": AROUND_A_CALL,
        "tools": [tool],
        "max_tokens": 40,
        "extra_body": GREEDY,
    }
    full = an.messages.create(**ask)
    with an.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    kinds = [block.type for block in full.content]
    assert kinds == ["text", "tool_use", "text"], full.content
    assert full.content[1].input == {"city": "Rome"}  # type: ignore[union-attr]
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in full.content
    ]
    assert full.stop_reason == streamed.stop_reason == "tool_use"

    function: Any = {"type": "function", **WEATHER}
    request: Any = {
        "model": MODEL,
        "input": AROUND_A_CALL,
        "tools": [function],
        "max_output_tokens": 40,
        "temperature": 0,
    }
    whole = oa.responses.create(**request)
    with oa.responses.stream(**request) as events:
        final = events.get_final_response()
    items = [(i.type, i.content[0].text if i.type == "message" else i.arguments) for i in whole.output]  # type: ignore[union-attr]
    assert [kind for kind, _ in items] == ["message", "function_call", "message"], items
    assert items == [
        (i.type, i.content[0].text if i.type == "message" else i.arguments) for i in final.output
    ]  # type: ignore[union-attr]


def test_responses_stream_tools_and_format(oa: openai.OpenAI) -> None:
    full = oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    kinds, deltas = [], ""
    with oa.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    assert deltas == final.output_text == full.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):  # fmt: skip
        assert kind in kinds
    tool: Any = {"type": "function", **WEATHER}
    called = oa.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    call = called.output[-1]
    assert (
        call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    )
    arguments = ""
    with oa.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
    assert arguments == call.arguments
    followed = oa.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[tool], tool_choice="none", max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert followed.output_text
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    shaped = oa.responses.create(
        model=MODEL, input="Describe a person.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(shaped.output_text)) == {"name", "age"}


def test_previous_response_id_across_api_servers(server: str) -> None:
    """Each turn on a fresh connection, until the continuation lands on the other API server: the store
    is shared, so it finds the first turn; the two-turn text equals the chat door's."""
    first = openai_client(server).responses.with_raw_response.create(
        model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0
    )
    owner, parsed = first.headers["x-engine-server"], first.parse()
    for _ in range(40):
        second = openai_client(server).responses.with_raw_response.create(
            model=MODEL,
            input="And of Germany?",
            previous_response_id=parsed.id,
            max_output_tokens=16,
            temperature=0,
        )
        if second.headers["x-engine-server"] != owner:
            break
    else:  # (what the launcher runs now, and where fresh connections land, for whoever reads the failure)
        landed = [
            openai_client(server).models.with_raw_response.list().headers["x-engine-server"]
            for _ in range(10)
        ]
        report = listeners_report(int(server.rsplit(":", 1)[1]))
        pytest.fail(f"every request landed on API server {owner}; /v1/models on {landed}; {report}")
    chat = openai_client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": parsed.output_text},
                  {"role": "user", "content": "And of Germany?"}],
        max_tokens=16, temperature=0,
    )  # fmt: skip
    assert second.parse().output_text == chat.choices[0].message.content
    stored = openai_client(server).responses.retrieve(parsed.id)
    assert stored.status == "completed" and stored.output_text == parsed.output_text
    openai_client(server).responses.delete(parsed.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        openai_client(server).responses.retrieve(parsed.id)


def test_cancel_ends_a_running_response(server: str, oa: openai.OpenAI) -> None:
    events: list[Any] = []

    def run() -> None:
        with openai_client(server).responses.stream(
            model=MODEL, input="Write a very long story about a dragon.", max_output_tokens=900, temperature=0
        ) as stream:
            events.extend(stream)

    thread = threading.Thread(target=run)
    thread.start()
    response_id = wait_until(lambda: events and events[0].response.id, 60, "the response to start")
    cancelled = openai_client(server).responses.cancel(response_id)  # may land on either API server
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert cancelled.status == "cancelled"
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert oa.responses.retrieve(response_id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="in progress"):
        oa.responses.cancel(oa.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2).id)


@pytest.mark.parametrize(
    ("call", "status", "match"),
    [
        (lambda c: c.responses.create(model=MODEL, input=5), 400, "input"),
        (
            lambda c: c.responses.create(model=MODEL, input="x", previous_response_id="resp_nope"),
            404,
            "not found",
        ),
        (
            lambda c: c.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}]),
            400,
            "function tools only",
        ),
        (lambda c: c.responses.create(model=MODEL, input="x", background=True), 400, "background"),
        (
            lambda c: c.responses.create(model=MODEL, input="x", max_output_tokens=0),
            400,
            "max_tokens",
        ),  # (fuzz)
        (lambda c: c.responses.create(model="nope", input="x"), 404, "does not exist"),
        (lambda c: c.responses.retrieve("resp_nope"), 404, "not found"),
    ],
)
def test_responses_errors_are_openai_shaped(oa: openai.OpenAI, call: Any, status: int, match: str) -> None:
    with pytest.raises(openai.APIStatusError, match=match) as raised:
        call(oa)
    assert raised.value.status_code == status
    body: Any = raised.value.body
    assert set(body) >= {"message", "type", "param"}


ANTHROPIC_BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),  # required
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"max_tokens": 4, "messages": "hello"}, 400, "messages"),
    (
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        400,
        "nope",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{}]},
        400,
        "mcp_servers",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "image",
    ),
]


@pytest.mark.parametrize(("body", "status", "match"), ANTHROPIC_BAD)
def test_messages_errors_are_anthropic_shaped(
    server: str, body: dict[str, Any], status: int, match: str
) -> None:
    with httpx.Client(timeout=60) as http:
        answer = http.post(
            f"{server}/v1/messages",
            json={"model": MODEL, **body},
            headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
        )
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert match in error["error"]["message"]


def test_errors_are_counted_per_route(server: str, an: anthropic.Anthropic, oa: openai.OpenAI) -> None:
    """Each door's errors through its SDK, counted in the HTTP metrics under the route (one series for
    every response id, not one per id)."""
    before = scrape({"base": server})
    for name in ("resp_a", "resp_b"):
        with pytest.raises(openai.NotFoundError):
            oa.responses.retrieve(name)
    with pytest.raises(anthropic.NotFoundError) as missing:
        an.messages.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    after = scrape({"base": server})
    key = "engine:http_requests_total{method=POST,path=/v1/messages,status=%s}"
    assert after.get(key % 404, 0) - before.get(key % 404, 0) == 1
    assert after.get(key % 401, 0) - before.get(key % 401, 0) == 1, [k for k in after if "401" in k]
    by_id = "engine:http_requests_total{method=GET,path=/v1/responses/{response_id},status=404}"
    assert after.get(by_id, 0) - before.get(by_id, 0) == 2


def test_responses_honour_ignore_eos(oa: openai.OpenAI) -> None:
    """vLLM's ignore_eos, as the chat door takes it (a benchmark's fixed output length): the answer runs
    to max_output_tokens; without it the same greedy answer ends at the model's end of turn first."""
    common: Any = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 48, "temperature": 0}
    plain = oa.responses.create(**common)
    assert plain.usage is not None and plain.usage.output_tokens < 48 and plain.status == "completed"
    forced = oa.responses.create(**common, extra_body={"ignore_eos": True})
    assert forced.usage is not None and forced.usage.output_tokens == 48
    assert forced.status == "incomplete"  # stopped by max_output_tokens, as OpenAI reports it
