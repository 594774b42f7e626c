"""Reasoning through the chat door of a real `engine serve` on a tiny random Qwen3 (with SmolLM2's
tokenizer and a template that opens `<think>`): one server with the deepseek_r1 parser and a frontend
attached to its engine with the qwen3 parser. Each sends the reasoning to `message.reasoning` (and
`reasoning_content`), streamed as `delta.reasoning` and equal to the non-streamed one; a response cut
inside the thinking stays reasoning; enable_thinking false makes it content; include_reasoning false
leaves it out. The split at `</think>` on recorded outputs: tests/test_parsers.py."""

from __future__ import annotations

import pathlib
from typing import Any

import openai
import pytest

from tests.serve_helpers import serving
from tests.test_correctness_tiny import build_tiny

pytestmark = pytest.mark.slow

TEMPLATE = pathlib.Path(__file__).parent / "templates" / "hermes_tools.jinja"
QWEN3_TOOLS = (pathlib.Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()


@pytest.fixture(scope="module")
def clients(smollm2_tokenizer, tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-thinking"))
    tokenizer = smollm2_tokenizer
    build_tiny("qwen3", folder, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    common = ["--chat-template", str(TEMPLATE), "--served-model-name", "tiny"]
    engine = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "16"]
    with serving(
        folder, *engine, "--reasoning-parser", "deepseek_r1", *common, engine_address=True
    ) as server:
        assert server.engine_address is not None
        attach = ["--attach", server.engine_address, "--reasoning-parser", "qwen3", *common]
        with serving(folder, *attach) as attached:
            yield {
                name: openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
                for name, base in (("deepseek_r1", server.base), ("qwen3", attached.base))
            }


def request(thinking: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}, **extra},
    }


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_streamed_and_not(clients: dict[str, openai.OpenAI], parser: str) -> None:
    client = clients[parser]
    message = client.chat.completions.create(**request(True)).choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning"] and extra["reasoning_content"] == extra["reasoning"]
    assert message.content == ""  # cut by max_tokens inside the thinking: all of it stays reasoning
    streamed = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **request(True)):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            streamed["content"] += delta.content or ""
    assert streamed == {"reasoning": extra["reasoning"], "content": ""}
    off = client.chat.completions.create(**request(False)).choices[0].message
    assert off.content and not (off.model_extra or {}).get("reasoning")
    hidden = client.chat.completions.create(**request(True, include_reasoning=False)).choices[0].message
    assert "reasoning" not in (hidden.model_extra or {})


def test_thinking_through_messages_and_responses(clients: dict[str, openai.OpenAI]) -> None:
    """The same reasoning as the chat door's: Anthropic thinking blocks and thinking_delta events, a
    Responses reasoning item and reasoning_text events; disabled thinking gives only text."""
    import anthropic

    client = clients["deepseek_r1"]
    chat = client.chat.completions.create(**request(True)).choices[0].message
    reasoning = (chat.model_extra or {})["reasoning"]
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    messages = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    turns: Any = [{"role": "user", "content": "Why is the sky blue?"}]
    greedy: Any = {"temperature": 0}
    message = messages.messages.create(
        model="tiny", messages=turns, max_tokens=12, thinking={"type": "adaptive"}, extra_body=greedy
    )
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == reasoning  # type: ignore[union-attr]
    thinking = ""
    with messages.messages.stream(
        model="tiny", messages=turns, max_tokens=12, thinking={"type": "adaptive"}, extra_body=greedy
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking += event.delta.thinking
    assert thinking == reasoning
    off = messages.messages.create(
        model="tiny", messages=turns, max_tokens=12, thinking={"type": "disabled"}, extra_body=greedy
    )
    assert [block.type for block in off.content] == ["text"]
    opened: Any = {}  # no effort given: the template's enable_thinking, as the chat request sets it
    response = client.responses.create(
        model="tiny", input="Why is the sky blue?", max_output_tokens=12, temperature=0, reasoning=opened
    )
    item = response.output[0]
    assert item.type == "reasoning" and item.content and item.content[0].text == reasoning
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    streamed = ""
    with client.responses.stream(
        model="tiny", input="Why is the sky blue?", max_output_tokens=12, temperature=0, reasoning=opened
    ) as events:
        for event in events:
            if event.type == "response.reasoning_text.delta":
                streamed += event.delta
    assert streamed == reasoning


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_on_a_qwen3_style_template(clients: dict[str, openai.OpenAI], stream: bool) -> None:
    """The second turn of a tool loop as the SDK sends it (content null, arguments a JSON string; a result
    in text parts) on the tiny Qwen3 with a Qwen3-style tool template: the prompt holds the call with its
    arguments encoded once and the result in its <tool_response>."""
    import httpx

    client = clients["deepseek_r1"]
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: Any = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": [{"type": "text", "text": "rainy"}, {"type": "text", "text": "12 C"}]},
    ]  # fmt: skip
    extra = {"chat_template": QWEN3_TOOLS, "return_token_ids": True}
    common: Any = {
        "model": "tiny",
        "messages": messages,
        "tools": tools,
        "tool_choice": "none",
        "max_tokens": 4,
    }
    common["temperature"] = 0
    if stream:
        chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **common))
        assert chunks[-1].choices[0].finish_reason == "length"
        token_ids = (chunks[0].model_extra or {})["prompt_token_ids"]
    else:
        response = client.chat.completions.create(extra_body=extra, **common)
        assert response.choices[0].finish_reason == "length"
        token_ids = (response.model_extra or {})["prompt_token_ids"]
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    prompt = httpx.post(f"{base}/detokenize", json={"tokens": token_ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrainy\n12 C\n</tool_response>" in prompt
