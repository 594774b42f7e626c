"""An MCP server for the tests of the Responses API's mcp tools (tests/test_serve_mcp.py), run as
`python -m tests.mcp_server NAME TRANSPORT PORT`: the `mcp` SDK's MCPServer (FastMCP in SDK 1.x) with
a weather tool, a tool slower than any test's timeout, one that fails, one that ends the server, and
(on streamable HTTP) a /garbage endpoint that answers what no MCP client can read."""

from __future__ import annotations

import os
import sys
import time

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route


def build(name: str) -> MCPServer:
    server = MCPServer(name)

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def get_weather(city: str) -> str:
        """The weather in a city"""
        return f"Sunny, 21 C in {city}"

    @server.tool()
    def slow_lookup(number: int) -> str:
        """Looks a number up, slowly"""
        time.sleep(30)
        return str(number)

    @server.tool()
    def broken(number: int) -> str:
        """Always fails"""
        raise RuntimeError(f"no data for {number}")

    @server.tool()
    def shutdown() -> str:
        """Ends the server"""
        os._exit(0)

    # a strict schema, as well-kept servers publish: SmolLM2, forced to call a tool, writes properties
    # the schema does not forbid until its tokens run out
    for tool in ("get_weather", "slow_lookup", "broken", "shutdown"):
        server._tool_manager.get_tool(tool).parameters["additionalProperties"] = False
    return server


async def garbage(request: Request) -> PlainTextResponse:
    return PlainTextResponse("<html>this is not JSON-RPC</html>", media_type="application/json")


def main() -> None:
    name, transport, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = build(name)
    if transport == "sse":
        app = server.sse_app(host="127.0.0.1")
    else:
        app = server.streamable_http_app(host="127.0.0.1")
        app.router.routes.append(Route("/garbage", garbage, methods=["GET", "POST", "DELETE"]))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
