"""Talking to MCP servers for the Responses API's `mcp` tools, through the `mcp` SDK: list a server's
tools, call one, each on a connection of its own, bounded by a timeout, so that a server that is down,
slow or answers garbage is an error value, never an exception out of the door or a hung request.

A URL whose path ends in /sse speaks the SSE transport (what vLLM's `--tool-server host:port` serves
at http://host:port/sse); any other, streamable HTTP.

`ToolServers` are the operator's (`--tool-server`): a request names one by its label, the name its
server reports when it initializes (as vLLM labels them). A request may also name a `server_url` of
its own, fetched only if `--mcp-allowed-urls` lists it (`check_allowed`)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio

from frontend.config.tool_server import tool_server_url
from frontend.server.errors import OpenAIError

# NOTE: the mcp SDK (and its httpx2) is imported where a request first uses it: importing it costs
# ~0.65 s, which every API server's start would pay.

logger = logging.getLogger("engine.api")

MAX_OUTPUT_CHARS = 1 << 20  # a tool's answer longer than this is an error (it would not fit a prompt)


@dataclass(frozen=True)
class ServerRef:
    """One MCP server a request's tools come from."""

    label: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class CallResult:
    """A tool call's answer: its text (output), or an error in the Responses API's shape."""

    output: str | None = None
    error: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """What the model reads as the tool's message."""
        if self.error is None:
            return self.output or ""
        return f"Error: {error_message(self.error)}"


def error_message(error: dict[str, Any] | str) -> str:
    if isinstance(error, str):
        return error
    if "message" in error:
        return str(error["message"])
    return json.dumps(error.get("content"))


def check_allowed(url: str, allowed: list[str], param: str) -> None:
    """A request's server_url: fetched only when an --mcp-allowed-urls entry names it (an origin,
    scheme://host:port, allows every path on it; an entry with a path allows that URL alone)."""
    try:
        parts = urlsplit(url)
        origin = (parts.scheme, parts.hostname, parts.port)
    except ValueError:  # a port that is not a number
        origin = ("", None, None)
    if origin[0] not in ("http", "https") or not origin[1]:
        raise OpenAIError(f"{param} must be an http(s) URL, got {url!r}.", param=param)
    for entry in allowed:
        allow = urlsplit(entry)
        if allow.path.strip("/"):
            if url.rstrip("/") == entry.rstrip("/"):
                return
        elif (allow.scheme, allow.hostname, allow.port) == origin:
            return
    raise OpenAIError(
        f"{param} {url!r} is not on this server's --mcp-allowed-urls: the server fetches only the MCP "
        "servers its operator allows (or name a --tool-server by its server_label, without server_url).",
        param=param,
    )


@asynccontextmanager
async def session(server: ServerRef) -> AsyncIterator[Any]:
    import httpx2
    from mcp import ClientSession
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client

    if urlsplit(server.url).path.rstrip("/").endswith("/sse"):
        transport = sse_client(server.url, headers=server.headers)
    else:
        transport = streamable_http_client(server.url, http_client=httpx2.AsyncClient(headers=server.headers))
    async with transport as streams, ClientSession(streams[0], streams[1]) as client:
        await client.initialize()
        yield client


def failure(error: Exception, timeout_s: float) -> dict[str, Any]:
    """An exception from the SDK or the transport as a Responses API mcp_call error."""
    import httpx2
    from mcp import MCPError

    if isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
        inner = error.exceptions[0]
        return failure(inner if isinstance(inner, Exception) else error, timeout_s)
    if isinstance(error, TimeoutError):
        return {
            "type": "http_error",
            "code": 504,
            "message": f"the MCP server did not answer in {timeout_s:g} s",
        }
    if isinstance(error, httpx2.HTTPStatusError):
        return {"type": "http_error", "code": error.response.status_code, "message": str(error)}
    if isinstance(error, httpx2.TransportError | OSError):
        return {"type": "http_error", "code": 502, "message": f"the MCP server could not be reached: {error}"}
    if isinstance(error, MCPError):
        return {"type": "mcp_protocol_error", "code": error.code, "message": str(error)}
    return {"type": "mcp_protocol_error", "code": -32603, "message": f"{type(error).__name__}: {error}"}


async def list_tools(server: ServerRef, timeout_s: float) -> tuple[list[dict[str, Any]], str | None]:
    """(the server's tools as mcp_list_tools lists them, None) or ([], the error)."""
    try:
        with anyio.fail_after(timeout_s):
            async with session(server) as client:
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor) if cursor else await client.list_tools()
                    listed += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
    except Exception as error:
        logger.warning("listing the tools of MCP server %r failed: %s", server.label, error)
        return [], error_message(failure(error, timeout_s))
    tools = []
    for tool in listed:
        annotations = (
            tool.annotations.model_dump(exclude_none=True, by_alias=True) if tool.annotations else None
        )
        tools.append({
            "name": tool.name,
            "description": tool.description,
            "input_schema": tool.input_schema,
            "annotations": annotations,
        })  # fmt: skip
    return tools, None


async def call_tool(server: ServerRef, name: str, arguments: str, timeout_s: float) -> CallResult:
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError as error:
        return CallResult(
            error={"type": "mcp_protocol_error", "code": -32602, "message": f"arguments: {error}"}
        )
    if not isinstance(parsed, dict):
        message = "arguments must be a JSON object"
        return CallResult(error={"type": "mcp_protocol_error", "code": -32602, "message": message})
    try:
        with anyio.fail_after(timeout_s):
            async with session(server) as client:
                result = await client.call_tool(name, parsed)
    except Exception as error:
        return CallResult(error=failure(error, timeout_s))
    content = [block.model_dump(exclude_none=True, by_alias=True) for block in result.content]
    if result.is_error:
        return CallResult(error={"type": "mcp_tool_execution_error", "content": content})
    texts = [block["text"] if block.get("type") == "text" else json.dumps(block) for block in content]
    output = "\n".join(texts)
    if len(output) > MAX_OUTPUT_CHARS:
        message = f"the tool's output of {len(output)} characters is over the limit of {MAX_OUTPUT_CHARS}"
        return CallResult(error={"type": "mcp_protocol_error", "code": -32603, "message": message})
    return CallResult(output=output)


class ToolServers:
    """The operator's MCP servers (--tool-server), found by the label each reports when it initializes.
    Labels are learned on first use and kept; a server that was down is asked again next time."""

    def __init__(self, specs: list[str], timeout_s: float) -> None:
        self.urls = [tool_server_url(spec) for spec in specs]
        self.timeout_s = timeout_s
        self._labels: dict[str, str] = {}  # label -> url, for the servers that answered

    async def find(self, label: str, headers: dict[str, str]) -> ServerRef:
        if label not in self._labels:
            await self._learn()
        url = self._labels.get(label)
        if url is None:
            known = ", ".join(sorted(self._labels)) or "none"
            down = [url for url in self.urls if url not in self._labels.values()]
            raise OpenAIError(
                f"No --tool-server is labeled {label!r} (labels: {known}"
                + (f"; not answering: {', '.join(down)}" if down else "")
                + "). Name a tool server's label, or give a server_url on --mcp-allowed-urls.",
                param="tools",
            )
        return ServerRef(label, url, headers)

    async def _learn(self) -> None:
        for url in self.urls:
            if url in self._labels.values():
                continue
            try:
                with anyio.fail_after(self.timeout_s):
                    async with session(ServerRef(url, url)) as client:
                        info = client.server_info
            except Exception as error:
                logger.warning("tool server %s did not answer: %s", url, error)
                continue
            self._labels[info.name if info is not None else url] = url
