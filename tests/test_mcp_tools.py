"""The Responses API's mcp tools without a server: which URLs a request may name, which calls wait for
approval, how MCP items render into the next turn's prompt, and the events a call's pieces make
(the loop itself runs end to end in tests/test_serve_mcp.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.config.tool_server import tool_server_url
from frontend.responses.mcp_client import ServerRef, check_allowed
from frontend.responses.mcp_tools import MCPServerTools, MCPToolset, ToolFilter, _approval, approvals
from frontend.responses.schemas import input_messages
from frontend.responses.tool_loop import ToolEvents
from frontend.server.errors import OpenAIError

READ = {"name": "read", "input_schema": {"type": "object"}, "annotations": {"readOnlyHint": True}}
WRITE = {"name": "write", "input_schema": {"type": "object"}, "annotations": None}


def server(require_approval: Any, tools: list[dict[str, Any]] | None = None) -> MCPServerTools:
    always, never = _approval(require_approval, "tools[0]")
    return MCPServerTools(ServerRef("s", "http://x/mcp"), None, None, always, never, tools or [READ, WRITE])


@pytest.mark.parametrize(
    ("require_approval", "read", "write"),
    [
        (None, True, True),  # OpenAI's default: ask
        ("always", True, True),
        ("never", False, False),
        ({"never": {"read_only": True}}, False, True),
        ({"never": {"tool_names": ["write"]}}, True, False),
        ({"always": {"tool_names": ["write"]}}, False, True),
        ({"always": {"read_only": False}, "never": {"read_only": True}}, False, True),
    ],
)
def test_which_calls_wait_for_approval(require_approval: Any, read: bool, write: bool) -> None:
    tools = server(require_approval)
    assert (tools.needs_approval(READ), tools.needs_approval(WRITE)) == (read, write)


def test_a_bad_require_approval_is_a_400() -> None:
    with pytest.raises(OpenAIError, match="require_approval"):
        _approval("sometimes", "tools[0]")


def test_allowed_tools_filter() -> None:
    assert ToolFilter(frozenset({"read"})).matches(READ) and not ToolFilter(frozenset({"read"})).matches(
        WRITE
    )
    assert ToolFilter(read_only=True).matches(READ) and not ToolFilter(read_only=True).matches(WRITE)


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:8000/mcp", True),
        ("http://127.0.0.1:8000/other/sse", True),  # an origin allows every path
        ("https://127.0.0.1:8000/mcp", False),  # another scheme
        ("http://127.0.0.1:8001/mcp", False),  # another port
        ("http://127.0.0.1:8000.evil.example/mcp", False),
        ("http://evil.example/?u=http://127.0.0.1:8000", False),
        ("http://tools.example/mcp", True),  # the one URL an entry with a path allows
        ("http://tools.example/mcp2", False),
        ("file:///etc/passwd", False),
    ],
)
def test_a_request_names_only_allowed_urls(url: str, allowed: bool) -> None:
    entries = ["http://127.0.0.1:8000", "http://tools.example/mcp"]
    if allowed:
        check_allowed(url, entries, "tools[0].server_url")
    else:
        with pytest.raises(OpenAIError):
            check_allowed(url, entries, "tools[0].server_url")


def test_tool_server_urls() -> None:
    assert tool_server_url("127.0.0.1:8000") == "http://127.0.0.1:8000/sse"  # vLLM's form
    assert tool_server_url("[::1]:8000") == "http://[::1]:8000/sse"
    assert tool_server_url("https://tools.example/mcp") == "https://tools.example/mcp"
    with pytest.raises(ValueError):
        tool_server_url("localhost")


def test_mcp_items_render_as_calls_and_results() -> None:
    call = {"type": "mcp_call", "id": "mcp_1", "server_label": "s", "name": "read", "arguments": '{"a": 1}',
            "output": "42", "error": None}  # fmt: skip
    failed = {
        **call,
        "id": "mcp_2",
        "output": None,
        "error": {"type": "http_error", "code": 504, "message": "slow"},
    }
    cut = {**call, "id": "mcp_3", "arguments": '{"a": ', "status": "incomplete"}  # never run
    asked = {
        "type": "mcp_approval_request",
        "id": "mcpr_1",
        "server_label": "s",
        "name": "write",
        "arguments": "{}",
    }
    declined = {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": False}
    listing = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "s", "tools": []}
    messages = input_messages(
        [{"role": "user", "content": "hi"}, listing, call, failed, cut, asked, declined]
    )
    roles = [message["role"] for message in messages]
    assert roles == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "read", "arguments": '{"a": 1}'}
    assert messages[2] == {"role": "tool", "tool_call_id": "mcp_1", "content": "42"}
    assert messages[4]["content"] == "Error: slow"
    assert messages[5]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert "declined" in messages[8]["content"]


def test_approvals_answer_only_asked_requests() -> None:
    asked = {
        "type": "mcp_approval_request",
        "id": "mcpr_1",
        "server_label": "s",
        "name": "write",
        "arguments": "{}",
    }
    answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}
    assert approvals([asked], [answer]) == [(asked, True)]
    ran = {"type": "mcp_call", "approval_request_id": "mcpr_1"}
    assert approvals([asked, ran], [answer]) == []  # already run
    with pytest.raises(OpenAIError, match="approval_request_id"):
        approvals([], [answer])


def test_a_call_streams_as_an_mcp_call_or_an_approval_request() -> None:
    toolset = MCPToolset()
    toolset.add(server({"never": {"tool_names": ["read"]}}), set())
    events = ToolEvents(toolset)
    frames = events.call("c1", "read", '{"a"') + events.call(None, None, ": 1}")
    frames += events.call("c2", "write", "{}") + events.call("c3", "other", "{}") + events.close()
    kinds = [json.loads(frame.split(b"data: ")[1])["type"] for frame in frames]
    assert kinds == [
        "response.output_item.added", "response.mcp_call.in_progress", "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",  # runs after the turn
        "response.output_item.added", "response.output_item.done",  # the approval request
        "response.output_item.added", "response.function_call_arguments.delta",  # a client's function
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    assert [item["type"] for item in events.items] == ["mcp_call", "mcp_approval_request", "function_call"]
    assert events.items[0]["arguments"] == '{"a": 1}' and events.pending == [0]
    done = events.finish(0, {"output": "42", "status": "completed"}, failed=False)
    assert [json.loads(frame.split(b"data: ")[1])["type"] for frame in done] == [
        "response.mcp_call.completed",
        "response.output_item.done",
    ]
