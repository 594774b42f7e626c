"""End to end through the official `openai` client on a real `engine serve` (SmolLM2, greedy): structured
outputs (50 generated JSON schemas, regex, choice, grammar, the SDK's parse()), a mixed batch that gives
each request its tokens alone, tool calling (required, named, auto, none; streamed and not; a tool-result
follow-up). Reasoning: tests/test_serve_reasoning.py."""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import re
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.serve_helpers import serving

pytestmark = pytest.mark.slow

MODEL = "smollm2"
TEMPLATE = (pathlib.Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["PARIS_FR", "ROME_IT"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def base(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    flags = [
        "--max-model-len", "2048", "--num-kv-blocks", "160", "--served-model-name", MODEL,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with serving(smollm2_gguf, *flags) as served:
        yield served.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Objects, nesting, enums, bounded arrays, patterns, bounded numbers, $ref."""
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern", "array"]
    if depth < 1:
        kinds += ["object", "ref"]
    properties = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "string":
            value: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 10)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            value = {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
        elif kind == "number":
            value = {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
        elif kind == "boolean":
            value = {"type": "boolean"}
        elif kind == "enum":
            value = {
                "enum": rng.sample(["red", "green", "blue", "cyan", "amber", 7, None], rng.randint(2, 4))
            }
        elif kind == "pattern":
            value = {
                "type": "string",
                "pattern": rng.choice(["^[a-z]{2,6}$", "^[A-Z][0-9]{3}$", "^(yes|no)$"]),
            }
        elif kind == "array":
            low = rng.randint(0, 2)
            item = rng.choice(
                [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 8}]
            )
            value = {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(1, 2)}
        elif kind == "object":
            value = random_schema(rng, depth + 1)
        else:
            value = {"$ref": "#/$defs/point"}
        properties[f"{kind}_{i}"] = value
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }
    if depth == 0:
        schema["$defs"] = {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer"},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        }
    return schema


def test_fifty_generated_schemas_always_parse_and_validate(base: str) -> None:
    rng = random.Random(24)
    schemas = [random_schema(rng) for _ in range(52)]

    async def one(aclient: openai.AsyncOpenAI, schema: dict[str, Any]) -> tuple[str, str | None]:
        response = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Fill in this JSON: {json.dumps(schema['properties'])}"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            },
            temperature=0,
            max_tokens=200,
        )
        choice = response.choices[0]
        return choice.message.content or "", choice.finish_reason

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600
        ) as aclient:
            return await asyncio.gather(*(one(aclient, schema) for schema in schemas))

    results = asyncio.run(run())
    finished = 0
    for schema, (text, reason) in zip(schemas, results, strict=True):
        if reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 48, [(reason, text[-80:]) for text, reason in results if reason != "stop"]


def test_regex_choice_and_grammar_through_both_doors(client: openai.OpenAI) -> None:
    pattern = r"(yes|no), because [a-z ]{3,30}\."
    for question in ("Is the sky blue?", "Can fish fly?"):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=40,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, chat.choices[0].message.content or "")
        completion = client.completions.create(
            model=MODEL,
            prompt=question,
            max_tokens=8,
            temperature=0,
            extra_body={"guided_choice": ["blue", "grey"]},
        )
        assert completion.choices[0].text in ("blue", "grey")
    grammar = 'root ::= "id-" [0-9] [0-9] [0-9]'
    completion = client.completions.create(
        model=MODEL, prompt="An id:", max_tokens=10, temperature=0, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"id-[0-9]{3}", completion.choices[0].text)


def test_the_sdk_parse_helper_gets_its_model(client: openai.OpenAI) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=120)

    response = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        temperature=0,
        max_tokens=60,
    )
    person = response.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_a_mixed_batch_gives_each_request_its_tokens_alone(base: str) -> None:
    rng = random.Random(7)
    constraints: list[dict[str, Any]] = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": random_schema(rng)},
            }
        },
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "b", "schema": random_schema(rng)},
            }
        },
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]+( [a-z]+){2,5}\\."}}},
        {},
        {},
    ]
    questions = [
        "Tell me about cats.",
        "Name a city.",
        "Give an object.",
        "Say a sentence.",
        "Hi!",
        "Count to 3.",
    ]

    async def one(aclient: openai.AsyncOpenAI, question: str, extra: dict[str, Any]) -> str:
        response = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=48,
            **extra,
        )
        return response.choices[0].message.content or ""

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300
        ) as aclient:
            alone = [await one(aclient, q, c) for q, c in zip(questions, constraints, strict=True)]
            together = await asyncio.gather(
                *(one(aclient, q, c) for q, c in zip(questions, constraints, strict=True))
            )
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
    assert json.loads(alone[2]) is not None and alone[4] and alone[5]


def stream_calls(client: openai.OpenAI, **request: Any) -> tuple[dict[int, list[str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function and call.function.name
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish


def test_required_and_named_tool_choice_always_give_valid_calls(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris, and the time?"}],
        "tools": [WEATHER, TIME],
        "temperature": 0,
        "max_tokens": 120,
    }
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        response = client.chat.completions.create(tool_choice=choice, **request)  # type: ignore[arg-type]
        message = response.choices[0].message
        assert message.tool_calls, message
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]
        assert response.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
        if choice != "required":
            assert [c.function.name for c in message.tool_calls] == ["get_time"]  # type: ignore[union-attr]
        streamed, finish = stream_calls(client, tool_choice=choice, **request)
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [  # type: ignore[union-attr]
            tuple(streamed[i]) for i in sorted(streamed)
        ]
        assert finish == response.choices[0].finish_reason
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **request)
    assert len(single.choices[0].message.tool_calls or []) == 1


def few_shot(city: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, (question, code) in enumerate((("Rome", "ROME_IT"), ("Paris", "PARIS_FR"), ("Rome", "ROME_IT"))):
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": code})},
        }
        messages += [
            {"role": "user", "content": f"What is the weather in {question}?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ]
    return [*messages, {"role": "user", "content": f"What is the weather in {city}?"}]


def test_auto_calls_are_parsed_and_constrained_from_the_marker_on(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": few_shot("Paris"),
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 60,
        "extra_body": {"chat_template": TEMPLATE},
    }
    response = client.chat.completions.create(**request)  # tool_choice defaults to auto with tools
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls", message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(
        json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
    )  # type: ignore[union-attr,index]
    streamed, finish = stream_calls(client, **request)
    assert (
        streamed == {0: ["get_weather", message.tool_calls[0].function.arguments]} and finish == "tool_calls"
    )  # type: ignore[union-attr]
    # "none": the same prompt, unconstrained and unparsed: the text holds what auto turned into a call
    plain = client.chat.completions.create(tool_choice="none", **request).choices[0].message
    assert not plain.tool_calls and "<tool_call>" in (plain.content or "")
    # the tool result goes back through the template: the follow-up turn renders and answers
    follow = [*request["messages"], {"role": "assistant", "tool_calls": [message.tool_calls[0].model_dump()]}]
    follow.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "rainy, 12 C"})
    answer = client.chat.completions.create(**{**request, "messages": follow, "tool_choice": "none"})
    assert answer.usage and answer.usage.prompt_tokens > response.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
        ),
    ],
)
def test_invalid_tools_and_schemas_are_400s(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **extra)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_the_sdk_tool_loop_renders_its_second_turn_on_the_default_template(
    client: openai.OpenAI, base: str
) -> None:
    """The SDK sends the call turn back as `content: null` with `tool_calls`, then the tool's result: on
    SmolLM2's own template (which concatenates content) the follow-up renders, streamed and not, and its
    prompt holds the result; a tool result given as text parts is joined with newlines."""

    def prompt_of(token_ids: list[int]) -> str:
        return str(httpx.post(f"{base}/detokenize", json={"tokens": token_ids}).json()["prompt"])

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    request: dict[str, Any] = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "max_tokens": 120}
    first = client.chat.completions.create(messages=question, tool_choice="required", **request)  # type: ignore[arg-type]
    call_turn = first.choices[0].message
    assert call_turn.content is None and call_turn.tool_calls, call_turn
    assert first.choices[0].finish_reason == "tool_calls"
    call_id = call_turn.tool_calls[0].id
    follow: list[Any] = [
        *question,
        call_turn,
        {"role": "tool", "tool_call_id": call_id, "content": "rainy, 12 C"},
    ]
    extra = {"extra_body": {"return_token_ids": True}, "max_tokens": 8}
    answer = client.chat.completions.create(messages=follow, **{**request, **extra})
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "rainy, 12 C" in prompt_of(answer.model_extra["prompt_token_ids"])  # type: ignore[index]
    # streamed: the call turn as a client rebuilds it from the chunks (arguments as a JSON string)
    streamed, finish = stream_calls(client, messages=question, tool_choice="required", **request)
    assert finish == "tool_calls" and streamed
    rebuilt = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in sorted(streamed.items())
        ],
    }
    parts = [{"type": "text", "text": "rainy,"}, {"type": "text", "text": "12 C"}]
    follow = [*question, rebuilt, {"role": "tool", "tool_call_id": "call_0", "content": parts}]
    chunks = list(client.chat.completions.create(messages=follow, stream=True, **{**request, **extra}))
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    assert "rainy,\n12 C" in prompt_of(chunks[0].model_extra["prompt_token_ids"])  # type: ignore[index]
