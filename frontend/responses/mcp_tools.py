"""A Responses request's `mcp` tools: which servers, which of their tools, which calls wait for the
user's approval, and the output items that record them (mcp_list_tools, mcp_call,
mcp_approval_request).

The servers' tools reach the model as function tools, rendered by the chat template and read back by
the server's tool-call parser, so every model with a parser can call them (docs/tool-calling.md). A
server already listed earlier in the conversation (an mcp_list_tools item in the history) is not
listed again: its tools come from that item, as OpenAI does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from frontend.openai.schemas import unsupported
from frontend.server.errors import OpenAIError

from .mcp_client import ServerRef, ToolServers, check_allowed, list_tools
from .output import new_id

MCP_FIELDS = {"type", "server_label", "server_url", "allowed_tools", "headers", "require_approval",
              "authorization", "server_description", "connector_id", "tunnel_id", "defer_loading",
              "allowed_callers"}  # fmt: skip
NOT_OURS = {"connector_id": "service connectors", "tunnel_id": "MCP tunnels", "defer_loading": "tool search"}


@dataclass(frozen=True)
class ToolFilter:
    """OpenAI's tool filter: names, and (or) the tools' readOnlyHint."""

    names: frozenset[str] | None = None
    read_only: bool | None = None

    def matches(self, tool: dict[str, Any]) -> bool:
        if self.names is not None and tool["name"] not in self.names:
            return False
        hint = bool((tool.get("annotations") or {}).get("readOnlyHint", False))
        return self.read_only is None or hint == self.read_only


@dataclass
class MCPServerTools:
    ref: ServerRef
    description: str | None
    allowed: ToolFilter | None  # None: every tool
    always: ToolFilter | None  # require_approval's filters; "always" and "never" are filters too
    never: ToolFilter | None
    tools: list[dict[str, Any]] = field(default_factory=list)  # listed and allowed

    def needs_approval(self, tool: dict[str, Any]) -> bool:
        """A tool the never filter names needs none; one the always filter names does; any other does
        unless an always filter names which do (OpenAI's default is to ask)."""
        if self.never is not None and self.never.matches(tool):
            return False
        return self.always is None or self.always.matches(tool)


@dataclass
class MCPToolset:
    """A request's MCP servers and their tools, by the name the model calls them."""

    servers: dict[str, MCPServerTools] = field(default_factory=dict)  # by label
    by_name: dict[str, tuple[MCPServerTools, dict[str, Any]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.servers)

    def functions(self) -> list[dict[str, Any]]:
        """The tools as the chat door's function tools."""
        functions = []
        for name, (server, tool) in self.by_name.items():
            description = tool.get("description") or ""
            if server.description:
                description = f"{server.description} ({server.ref.label}): {description}"
            function = {"name": name, "description": description, "parameters": tool["input_schema"]}
            functions.append({"type": "function", "function": function})
        return functions

    def add(self, server: MCPServerTools, taken: set[str]) -> None:
        for tool in server.tools:
            other = self.by_name.get(tool["name"])
            if other is not None or tool["name"] in taken:
                where = f"server {other[0].ref.label!r}" if other is not None else "a function tool"
                raise OpenAIError(
                    f"Tool {tool['name']!r} of MCP server {server.ref.label!r} has the name of {where}'s: the "
                    "model calls tools by name. Leave one out with allowed_tools.",
                    param="tools",
                )
            self.by_name[tool["name"]] = (server, tool)
        self.servers[server.ref.label] = server


def mcp_tool_specs(tools: list[dict[str, Any]] | None) -> list[tuple[int, dict[str, Any]]]:
    return [
        (i, tool)
        for i, tool in enumerate(tools or [])
        if isinstance(tool, dict) and tool.get("type") == "mcp"
    ]


async def resolve(
    specs: list[tuple[int, dict[str, Any]]],
    history: list[dict[str, Any]],
    tool_servers: ToolServers,
    allowed_urls: list[str],
    function_names: set[str],
) -> tuple[MCPToolset, list[tuple[MCPServerTools, str | None]]]:
    """The toolset, and the servers listed now with their listing's error (an mcp_list_tools item each)."""
    listed = {item.get("server_label"): item for item in history if item.get("type") == "mcp_list_tools"}
    toolset, fresh = MCPToolset(), []
    for index, spec in specs:
        server = await _server(spec, f"tools[{index}]", tool_servers, allowed_urls)
        if server.ref.label in toolset.servers:
            raise OpenAIError(
                f"tools[{index}]: server_label {server.ref.label!r} is given twice.", param="tools"
            )
        before = listed.get(server.ref.label)
        if before is not None and not before.get("error"):
            tools = list(before.get("tools") or [])
        else:
            tools, error = await list_tools(server.ref, tool_servers.timeout_s)
            fresh.append((server, error))
        server.tools = [tool for tool in tools if server.allowed is None or server.allowed.matches(tool)]
        toolset.add(server, function_names)
    return toolset, fresh


async def _server(
    spec: dict[str, Any], param: str, tool_servers: ToolServers, allowed_urls: list[str]
) -> MCPServerTools:
    for name in spec:
        if name not in MCP_FIELDS:
            raise unsupported(f"{param}.{name}", f"the mcp tool field {name!r}")
    for name, what in NOT_OURS.items():
        if spec.get(name):
            raise unsupported(f"{param}.{name}", what)
    if spec.get("allowed_callers") not in (None, ["direct"]):
        raise unsupported(f"{param}.allowed_callers", "programmatic tool calling")
    label = spec.get("server_label")
    if not isinstance(label, str) or not label:
        raise OpenAIError(f"{param}.server_label is required (a name for the server).", param="tools")
    headers = spec.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise OpenAIError(f"{param}.headers must map names to strings.", param="tools")
    if isinstance(spec.get("authorization"), str):
        headers = {**headers, "Authorization": f"Bearer {spec['authorization']}"}
    url = spec.get("server_url")
    if url is None:
        ref = await tool_servers.find(label, headers)
    else:
        check_allowed(str(url), allowed_urls, f"{param}.server_url")
        ref = ServerRef(label, str(url), headers)
    always, never = _approval(spec.get("require_approval"), param)
    return MCPServerTools(
        ref, spec.get("server_description"), _filter(spec.get("allowed_tools"), f"{param}.allowed_tools"),
        always, never,
    )  # fmt: skip


def _filter(value: Any, param: str) -> ToolFilter | None:
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return ToolFilter(frozenset(value))
    if isinstance(value, dict) and set(value) <= {"tool_names", "read_only"}:
        names = value.get("tool_names")
        return ToolFilter(frozenset(names) if names is not None else None, value.get("read_only"))
    raise OpenAIError(f"{param} is a list of tool names or {{tool_names, read_only}}.", param="tools")


def _approval(value: Any, param: str) -> tuple[ToolFilter | None, ToolFilter | None]:
    """require_approval as (always, never) filters: "always" (OpenAI's default) and "never" are the
    filters that match every tool."""
    if value is None or value == "always":
        return None, None
    if value == "never":
        return None, ToolFilter()
    if isinstance(value, dict) and set(value) <= {"always", "never"}:
        always = _filter(value.get("always"), f"{param}.require_approval.always")
        return always, _filter(value.get("never"), f"{param}.require_approval.never")
    raise OpenAIError(
        f"{param}.require_approval is always, never, or {{always: filter, never: filter}}.", param="tools"
    )


def list_tools_item(server: MCPServerTools, error: str | None) -> dict[str, Any]:
    tools = [{key: tool.get(key) for key in ("name", "description", "input_schema", "annotations")}
             for tool in server.tools]  # fmt: skip
    return {"type": "mcp_list_tools", "id": new_id("mcpl"), "server_label": server.ref.label, "tools": tools,
            "error": error}  # fmt: skip


def call_item(
    label: str, name: str, arguments: str, approval_request_id: str | None = None
) -> dict[str, Any]:
    return {"type": "mcp_call", "id": new_id("mcp"), "server_label": label, "name": name,
            "arguments": arguments, "output": None, "error": None, "status": "in_progress",
            "approval_request_id": approval_request_id}  # fmt: skip


def approval_item(label: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "mcp_approval_request", "id": new_id("mcpr"), "server_label": label, "name": name,
            "arguments": arguments}  # fmt: skip


def approvals(
    history: list[dict[str, Any]], new_items: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], bool]]:
    """The approval requests the new input answers, with each answer, in the order they were asked."""
    asked = {item["id"]: item for item in history if item.get("type") == "mcp_approval_request"}
    answered: dict[str, bool] = {}
    for index, item in enumerate(new_items):
        if item.get("type") != "mcp_approval_response":
            continue
        request_id = str(item.get("approval_request_id"))
        if request_id not in asked or not isinstance(item.get("approve"), bool):
            raise OpenAIError(
                f"input[{index}]: an mcp_approval_response needs the approval_request_id of an "
                "mcp_approval_request earlier in the conversation and approve: true or false.",
                param="input",
            )
        answered[request_id] = item["approve"]
    done = {item.get("approval_request_id") for item in history if item.get("type") == "mcp_call"}
    return [(asked[key], answered[key]) for key in asked if key in answered and key not in done]


def declined_text(item: dict[str, Any]) -> str:
    return f"The user declined the call of {item['name']} with {json.dumps(item['arguments'])}."
