"""End to end: the Responses API's mcp tools on a real `engine serve` (SmolLM2, the hermes tool parser)
against MCP servers of the `mcp` SDK on loopback (tests/mcp_server.py: one over SSE named by
--tool-server, one over streamable HTTP on --mcp-allowed-urls), driven by the openai SDK and the
Agents SDK's HostedMCPTool.

SmolLM2-135M does not call a tool on its own (tool_choice auto: it answers in text), so the first turn
names the tool (tool_choice {"type": "mcp", ...}: grammar-forced, as the chat door's named tools);
max_tool_calls 1 makes the next turn answer. The loop's second turn is checked against the chat door:
the same conversation, rendered by hand, gives the same prompt tokens and the same greedy text."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.serve_helpers import Served, free_port, serving, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2"
TEMPLATE = "tests/templates/hermes_tools.jinja"
WEATHER_CHOICE = {"type": "mcp", "server_label": "weather", "name": "get_weather"}
QUESTION = "Weather in Paris?"


def start_mcp(name: str, transport: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.mcp_server", name, transport, str(port)])

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the MCP server exited with {process.returncode}")
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    try:
        wait_until(up, 60, f"the {transport} MCP server")
    except BaseException:
        process.kill()
        raise
    return process, port


def end(process: subprocess.Popen[bytes]) -> None:
    """A test's MCP server has nothing to save: killed, not drained (a drain waits on open SSE streams and
    on the slow tool's call, seconds)."""
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def mcp_servers() -> Iterator[dict[str, int]]:
    sse, sse_port = start_mcp("weather", "sse")
    http, http_port = start_mcp("tools", "streamable-http")
    try:
        yield {"sse": sse_port, "http": http_port}
    finally:
        end(sse)
        end(http)


@pytest.fixture(scope="module")
def served(smollm2_gguf: str, mcp_servers: dict[str, int]) -> Iterator[Served]:
    spare = free_port()  # allowed; nothing listens (a server that is down) but while a test starts one
    with serving(
        smollm2_gguf, "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL,
        "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--tool-server", f"127.0.0.1:{mcp_servers['sse']}",
        "--mcp-allowed-urls", f"http://127.0.0.1:{mcp_servers['http']}", f"http://127.0.0.1:{spare}",
        "--mcp-timeout", "3",
    ) as served:  # fmt: skip
        served.spare_port = spare  # type: ignore[attr-defined]
        yield served


@pytest.fixture(scope="module")
def oa(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=120)


def weather_tool(**extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "weather", "allowed_tools": ["get_weather"],
            "require_approval": "never", **extra}  # fmt: skip


def http_tool(mcp_servers: dict[str, int], path: str = "/mcp", **extra: Any) -> dict[str, Any]:
    url = f"http://127.0.0.1:{mcp_servers['http']}{path}"
    return {"type": "mcp", "server_label": "tools", "server_url": url, **extra}


def plain(items: list[Any]) -> list[dict[str, Any]]:
    """Output items without their ids (each response makes its own)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in items]


def test_the_loop_runs_a_tool_and_answers_as_the_chat_door_would(oa: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model=MODEL, input=QUESTION, tools=[weather_tool()], tool_choice=WEATHER_CHOICE, max_tool_calls=1,
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    response = oa.responses.create(**request)
    listing, call, message = response.output
    assert listing.type == "mcp_list_tools" and listing.server_label == "weather" and listing.error is None
    assert [tool.name for tool in listing.tools] == ["get_weather"]
    assert listing.tools[0].annotations == {"readOnlyHint": True}
    assert call.type == "mcp_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.output == "Sunny, 21 C in Paris"
    assert message.type == "message"

    # the second turn is the chat door's answer to the conversation with the tool's result in it
    tool = listing.tools[0]
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    tools: Any = [{"type": "function", "function": function}]
    first = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0,
    )  # fmt: skip
    assert first.choices[0].message.tool_calls[0].function.arguments == call.arguments  # type: ignore[index, union-attr]
    messages: Any = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": call.output},
    ]  # fmt: skip
    assert first.usage is not None
    second = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="none", temperature=0,
        max_tokens=60 - first.usage.completion_tokens,
    )  # fmt: skip
    assert second.usage is not None and response.usage is not None
    assert message.content[0].text == second.choices[0].message.content  # type: ignore[union-attr]
    assert response.status == ("incomplete" if second.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert response.usage.output_tokens == first.usage.completion_tokens + second.usage.completion_tokens

    # streamed: OpenAI's events, and the same items
    kinds, arguments, final = [], "", None
    with oa.responses.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.mcp_call_arguments.delta":
                arguments += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None
    assert plain(final.output) == plain(response.output) and arguments == call.arguments
    for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                 "response.mcp_call.in_progress", "response.mcp_call_arguments.done",
                 "response.mcp_call.completed", "response.output_text.delta"):  # fmt: skip
        assert kind in kinds
    assert kinds.index("response.mcp_call.completed") < kinds.index("response.output_text.delta")
    assert kinds[-1] == f"response.{response.status}"
    assert plain(oa.responses.retrieve(response.id).output) == plain(response.output)


def test_approval_then_previous_response_id(oa: openai.OpenAI, mcp_servers: dict[str, int]) -> None:
    tools: Any = [http_tool(mcp_servers, allowed_tools={"read_only": True})]  # get_weather alone
    asked = oa.responses.create(
        model=MODEL, input=QUESTION, tools=tools, tool_choice={**WEATHER_CHOICE, "server_label": "tools"},
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    listing, request = asked.output
    assert [tool.name for tool in listing.tools] == ["get_weather"]
    assert (
        request.type == "mcp_approval_request" and request.name == "get_weather"
    )  # "always": OpenAI's default
    assert asked.status == "completed"
    approved = oa.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=tools, max_tool_calls=1, temperature=0,
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}],
        max_output_tokens=40,
    )  # fmt: skip
    call = approved.output[0]  # the tools are not listed again: the conversation has them
    assert call.type == "mcp_call" and call.approval_request_id == request.id
    assert call.output == "Sunny, 21 C in Paris" and approved.output[-1].type == "message"
    declined = oa.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=tools, tool_choice="none", temperature=0,
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": False}],
        max_output_tokens=8,
    )  # fmt: skip
    assert [item.type for item in declined.output] == ["message"]
    assert declined.usage is not None and declined.usage.input_tokens > asked.usage.input_tokens  # type: ignore[union-attr]


def call_of(oa: openai.OpenAI, tool: dict[str, Any], name: str) -> Any:
    response = oa.responses.create(
        model=MODEL, input="Look up 42", tools=[{**tool, "require_approval": "never"}], max_tool_calls=1,
        tool_choice={"type": "mcp", "server_label": tool["server_label"], "name": name}, temperature=0,
        max_output_tokens=40,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "mcp_call"]
    assert response.status in ("completed", "incomplete") and len(calls) == 1, response.output
    assert isinstance(json.loads(calls[0].arguments), dict), calls[0]  # whole: the call ran
    return calls[0]


def test_a_slow_a_failing_and_a_dying_server_are_call_errors(
    oa: openai.OpenAI, served: Served, mcp_servers: dict[str, int]
) -> None:
    slow = call_of(oa, http_tool(mcp_servers), "slow_lookup")
    assert slow.status == "failed" and slow.error.type == "http_error" and slow.error.code == 504
    broken = call_of(oa, http_tool(mcp_servers), "broken")
    assert broken.status == "failed" and broken.error.type == "mcp_tool_execution_error"
    assert "Error executing tool broken" in json.dumps(broken.error.content)
    dying, port = start_mcp("dying", "streamable-http", served.spare_port)  # type: ignore[attr-defined]
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        died = call_of(oa, {"type": "mcp", "server_label": "dying", "server_url": url}, "shutdown")
        assert dying.wait(timeout=30) == 0  # the call ended it
    finally:
        end(dying)
    assert died.status == "failed" and died.error.type in ("http_error", "mcp_protocol_error")


def test_listing_a_down_or_garbage_server_is_an_item_error(oa: openai.OpenAI, served: Served) -> None:
    mcp_servers = {"http": served.spare_port}  # type: ignore[attr-defined]
    down = oa.responses.create(model=MODEL, input="Hi", tools=[http_tool(mcp_servers)], max_output_tokens=4)
    assert down.output[0].type == "mcp_list_tools" and "could not be reached" in down.output[0].error
    assert down.output[-1].type == "message"


def test_garbage_server(oa: openai.OpenAI, mcp_servers: dict[str, int]) -> None:
    garbage = oa.responses.create(
        model=MODEL, input="Hi", tools=[http_tool(mcp_servers, "/garbage")], max_output_tokens=4
    )
    assert garbage.output[0].type == "mcp_list_tools" and garbage.output[0].error
    assert garbage.output[0].tools == [] and garbage.output[-1].type == "message"


@pytest.mark.parametrize(
    ("tool", "match"),
    [
        (
            {"type": "mcp", "server_label": "x", "server_url": "http://169.254.169.254/latest"},
            "--mcp-allowed-urls",
        ),
        ({"type": "mcp", "server_label": "nope"}, "No --tool-server is labeled 'nope'"),
        ({"type": "mcp", "server_label": "weather", "connector_id": "connector_gmail"}, "connector_id"),
        ({"type": "mcp", "server_label": "weather", "require_approval": "sometimes"}, "require_approval"),
        ({"type": "mcp", "server_label": "weather", "surprise": 1}, "surprise"),
    ],
)
def test_request_errors(oa: openai.OpenAI, tool: dict[str, Any], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        oa.responses.create(model=MODEL, input="Hi", tools=[tool], max_output_tokens=4)  # type: ignore[list-item]


def test_max_tool_calls_is_checked(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tool_calls"):
        oa.responses.create(model=MODEL, input="Hi", tools=[weather_tool()], max_tool_calls=0)


def test_agents_sdk_hosted_mcp_tool(served: Served, mcp_servers: dict[str, int]) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0)
        config: Any = {**http_tool(mcp_servers, allowed_tools=["get_weather"]), "require_approval": "never"}
        agent = agents.Agent(
            name="weather",
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            tools=[agents.HostedMCPTool(tool_config=config)],
            model_settings=agents.ModelSettings(
                temperature=0, max_tokens=200, tool_choice="get_weather", extra_args={"max_tool_calls": 1}
            ),
        )
        try:
            return await agents.Runner.run(agent, QUESTION)
        finally:
            await client.close()

    result = asyncio.run(run())
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["MCPListToolsItem", "ToolCallItem", "MessageOutputItem"]
    assert result.new_items[1].raw_item.output == "Sunny, 21 C in Paris"
    assert isinstance(result.final_output, str)
