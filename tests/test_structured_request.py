"""Request fields -> the StructuredOutputsParams the engine gets, without an engine: OpenAI's
response_format forms, vLLM's structured_outputs object and legacy guided_* fields, and the grammar each
tool_choice sends (required: an array of known calls; named: that function's parameters; auto: the
parser's structural tag; none: nothing); functions/function_call map onto tools/tool_choice."""

from __future__ import annotations

import json

import pytest

from frontend.engine.async_llm import AsyncLLM
from frontend.engine.client import AsyncEngineClient
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from frontend.openai.serving import OpenAIServing
from frontend.openai.structured import SpecValidator, spec_of_request
from frontend.openai.tools import plan_chat, select_tools
from frontend.server.errors import OpenAIError
from protocol.messages import ModelInfo
from protocol.structured_outputs import StructuredOutputsParams
from structured_outputs.guidance import DEFAULT_WHITESPACE, json_options

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def completion(**fields) -> CompletionRequest:  # type: ignore[no-untyped-def]
    return CompletionRequest(prompt="x", **fields)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputsParams(choice=["x", "y"])),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutputsParams(grammar='root ::= "a"'),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
        ),
        ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_grammar": "start: /[a-z]+/"}, StructuredOutputsParams(grammar="start: /[a-z]+/")),
        ({"guided_regex": "a", "guided_decoding_backend": "guidance"}, StructuredOutputsParams(regex="a")),
    ],
)
def test_each_request_form_maps_onto_one_spec(fields: dict, expected: StructuredOutputsParams | None) -> None:
    validator = SpecValidator("guidance")
    assert spec_of_request(completion(**fields), validator) == expected
    assert spec_of_request(ChatCompletionRequest(**CHAT, **fields), validator) == expected
    if expected is not None:
        assert len(validator.passed) == 1, "the second request's spec was remembered, not compiled again"


def test_whitespace_options() -> None:
    assert json_options(StructuredOutputsParams(json=SCHEMA))["whitespace_pattern"] == DEFAULT_WHITESPACE
    assert (
        json_options(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))["whitespace_flexible"]
        is False
    )
    assert (
        json_options(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" "))["whitespace_pattern"]
        == " "
    )


@pytest.fixture(scope="module")
def serving():  # type: ignore[no-untyped-def]
    client = AsyncEngineClient(
        "ipc:///tmp/engine-structured-test-in", "ipc:///tmp/engine-structured-test-out"
    )
    info = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0")
    yield OpenAIServing(AsyncLLM(client, None), info, enable_auto_tool_choice=True, tool_call_parser="hermes")
    client.close()


def plan(serving: OpenAIServing, **fields):  # type: ignore[no-untyped-def]
    body = ChatCompletionRequest(**CHAT, **fields)
    return plan_chat(body, serving, select_tools(body, serving), spec_of_request(body, serving.validator), "")


def test_tool_choice_sends_its_grammar(serving: OpenAIServing) -> None:
    required = plan(serving, tools=[TOOL], tool_choice="required")
    schema = required.spec.json  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == SCHEMA
    assert (
        plan(serving, tools=[TOOL], tool_choice="required", parallel_tool_calls=False).spec.json["maxItems"]
        == 1
    )  # type: ignore[union-attr]
    named = plan(serving, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.spec == StructuredOutputsParams(json=SCHEMA)
    auto = plan(serving, tools=[TOOL])
    tag = json.loads(auto.spec.structural_tag)  # type: ignore[union-attr,arg-type]
    assert tag["triggers"] == ["<tool_call>"] and tag["structures"][0]["schema"] == SCHEMA
    # the caller's own constraint wins over the tag in auto; none sends nothing
    assert plan(
        serving, tools=[TOOL], response_format={"type": "json_object"}
    ).spec == StructuredOutputsParams(json_object=True)
    assert plan(serving, tools=[TOOL], tool_choice="none").spec is None
    legacy = plan(serving, functions=[TOOL["function"]], function_call={"name": "f"})
    assert legacy.tool_choice == "named" and legacy.spec == StructuredOutputsParams(json=SCHEMA)


def test_auto_needs_the_server_flags(serving: OpenAIServing) -> None:
    plain = OpenAIServing(serving.llm, serving.model_info)
    body = ChatCompletionRequest(**CHAT, tools=[TOOL])
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        select_tools(body, plain)
    assert (
        select_tools(ChatCompletionRequest(**CHAT, tools=[TOOL], tool_choice="required"), plain).choice
        == "required"
    )


def test_parallel_tool_calls_false_keeps_one_call_under_auto(serving: OpenAIServing) -> None:
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'
    )
    assert len(plan(serving, tools=[TOOL]).parse(text, final=True).calls) == 2
    single = plan(serving, tools=[TOOL], parallel_tool_calls=False).parse(text, final=True)
    assert [c.arguments for c in single.calls] == ['{"a": 1}']
