"""One response, turn by turn: the model answers; where it called MCP tools, the server runs the calls,
appends their results, and lets the model answer again, until it answers without calling one, calls a
tool the client runs (a function tool), waits for an approval, or reaches `max_tool_calls`.

Every turn is one engine request on the chat rendering path, its prompt the conversation so far (the
earlier turns' mcp_call items render as the assistant's calls and the tools' messages). Streamed or
not, the response is built by the same events (`ToolEvents`), so a stream's items equal the body's.

Bounds: `max_tool_calls` (DEFAULT_MAX_TOOL_CALLS when unset) counts the calls one response runs; once
it is reached the next turn runs with tool_choice "none", and calls beyond it are failed mcp_call items
that say so. `max_output_tokens` bounds the output of all turns together. Each call has the server's
--mcp-timeout. tool_choice "required" or a named tool holds for the first turn; later turns are
"auto" (else the model could never answer)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from frontend.engine.output_processor import RequestState
from frontend.engine.pieces import formatted
from frontend.openai.chat import start_chat
from frontend.openai.serving import OpenAIServing
from frontend.server.errors import OpenAIError

from .mcp_client import CallResult, call_tool
from .mcp_tools import (
    MCPToolset,
    approval_item,
    approvals,
    call_item,
    list_tools_item,
    mcp_tool_specs,
    resolve,
)
from .output import EventStream, status_of
from .schemas import ResponsesRequest, to_chat_request

DEFAULT_MAX_TOOL_CALLS = 32
MCP_ITEMS = ("mcp_call", "mcp_approval_request")


class ToolEvents(EventStream):
    """The Responses events, where a call of an MCP tool is an mcp_call item (run after its turn) or
    an mcp_approval_request (when the server's require_approval asks)."""

    def __init__(self, toolset: MCPToolset) -> None:
        super().__init__()
        self.toolset = toolset
        self.pending: list[int] = []  # output indexes of mcp_call items this turn made, to run

    def call(self, parser_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        found = self.toolset.by_name.get(name or "") if parser_id is not None else None
        if (
            found is None
            if parser_id is not None
            else self.open is None or self.open["type"] not in MCP_ITEMS
        ):
            return super().call(parser_id, name, arguments)  # a function tool's call (the client runs it)
        events: list[bytes] = []
        if found is not None:  # a call starts
            server, tool = found
            label = server.ref.label
            if server.needs_approval(tool):
                events = self._start(approval_item(label, tool["name"], ""), None)
            else:
                events = self._start(call_item(label, tool["name"], ""), None)
                events.append(self.event("response.mcp_call.in_progress", **self._where()))
        self.text += arguments
        if arguments and self.open is not None and self.open["type"] == "mcp_call":
            events.append(self.event("response.mcp_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def close(self) -> list[bytes]:
        item = self.open
        if item is None or item["type"] not in MCP_ITEMS:
            return super().close()
        events, where = [], self._where()
        item = {**item, "arguments": self.text}
        if item["type"] == "mcp_call":  # its output item is done once it has run (`finish`)
            events.append(self.event("response.mcp_call_arguments.done", **where, arguments=self.text))
            self.pending.append(self.output_index)
        else:
            events.append(self.event("response.output_item.done", output_index=self.output_index, item=item))
        self.items.append(item)
        self.open = None
        return events

    def add(self, item: dict[str, Any]) -> list[bytes]:
        """An item the server makes (a listing, an approved call), opened: `finish` closes it."""
        events = self.close()
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        kind = {"mcp_call": "response.mcp_call", "mcp_list_tools": "response.mcp_list_tools"}[item["type"]]
        events.append(self.event(f"{kind}.in_progress", item_id=item["id"], output_index=index))
        if item["type"] == "mcp_call":
            self.pending.append(index)
        return events

    def finish(self, index: int, fields: dict[str, Any], failed: bool) -> list[bytes]:
        item = self.items[index] = {**self.items[index], **fields}
        kind = {"mcp_call": "response.mcp_call", "mcp_list_tools": "response.mcp_list_tools"}[item["type"]]
        where = {"item_id": item["id"], "output_index": index}
        return [
            self.event(f"{kind}.{'failed' if failed else 'completed'}", **where),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


class ToolLoop:
    """The turns of one response (see the module's doc). `run` yields its stream's events; what it
    built is `events.items`, `usage`, and the last turn's `state`."""

    def __init__(
        self,
        serving: OpenAIServing,
        body: ResponsesRequest,
        request: Request,
        conversation: list[dict[str, Any]],
        response_id: str,
    ) -> None:
        self.serving, self.body, self.request = serving, body, request
        self.conversation = conversation  # the history and this input: what the first turn reads
        self.response_id = response_id
        self.toolset = MCPToolset()
        self.events = ToolEvents(self.toolset)
        self.engine_request_id: str | None = None  # the running turn's (a cancel aborts it)
        self.state: RequestState | None = None  # the last turn's
        self.num_prompt_tokens = self.num_cached_tokens = self.num_output_tokens = 0
        self.num_calls = 0
        self.max_calls = body.max_tool_calls or DEFAULT_MAX_TOOL_CALLS
        self.out_of_tokens = False
        self.listings: list[dict[str, Any]] = []  # mcp_list_tools items of the servers listed now
        self.approved: list[dict[str, Any]] = []  # mcp_call items the input approved, to run first
        self.first: Any = None  # the first turn's stream, started by `prepare`
        self._turn_start = 0
        self.on_turn: Callable[[], Awaitable[None]] | None = None  # called as each later turn starts

    async def prepare(self, history: list[dict[str, Any]], new_items: list[dict[str, Any]]) -> None:
        """Before the response is created (its errors are the request's): list the request's MCP servers
        (400s for tools it may not use), find the approvals its input answers, and start the first turn
        unless approved calls must run first."""
        specs = mcp_tool_specs(self.body.tools)
        answered = approvals(history, new_items)
        if specs or answered:
            if not (self.serving.enable_auto_tool_choice and self.serving.tool_call_parser):
                raise OpenAIError(
                    "mcp tools need --enable-auto-tool-choice and --tool-call-parser: the model calls them "
                    "as function tools, read by the server's parser.",
                    param="tools",
                )
            functions = {str(t.get("name")) for t in self.body.tools or []
                         if isinstance(t, dict) and t.get("type") == "function"}  # fmt: skip
            self.toolset, fresh = await resolve(
                specs, history, self.serving.tool_servers, self.serving.mcp_allowed_urls, functions
            )
            self.events.toolset = self.toolset
            self.listings = [list_tools_item(server, error) for server, error in fresh]
            self.approved = [call_item(asked["server_label"], asked["name"], asked["arguments"], asked["id"])
                             for asked, approve in answered if approve]  # fmt: skip
        if not self.approved:
            self.first = await self._start_turn(0)

    async def run(self) -> AsyncIterator[bytes]:
        events = self.events
        for item in self.listings:
            for event in [
                *events.add(item),
                *events.finish(len(events.items) - 1, {}, item["error"] is not None),
            ]:
                yield event
        for item in self.approved:
            for event in events.add(item):
                yield event
        async for event in self._run_pending():
            yield event
        turn = 0
        while True:
            stream = self.first if turn == 0 and self.first is not None else await self._start_turn(turn)
            if stream is None:
                break
            try:
                async for state, delta in stream:
                    out = formatted(delta.pieces, events)
                    if delta.finish_reason is not None:
                        out += events.close()
                        self._count(state)
                    for event in out:
                        yield event
            finally:
                await stream.aclose()  # a client that left: the turn's engine request is aborted now
            assert self.state is not None
            ran = bool(events.pending)
            complete = self.state.choices[0].finish_reason in ("stop", "tool_calls")
            async for event in self._run_pending(complete):
                yield event
            waits = any(
                item["type"] in ("mcp_approval_request", "function_call") for item in self._turn_items
            )
            if not ran or waits or not complete:
                break
            turn += 1

    @property
    def status(self) -> tuple[str, dict[str, str] | None]:
        assert self.state is not None
        if self.out_of_tokens:
            return "incomplete", {"reason": "max_output_tokens"}
        choice = self.state.choices[0]
        return status_of(choice.finish_reason, choice.stop_reason)

    async def _start_turn(self, turn: int) -> Any:
        body = self.body
        max_tokens = None  # the first turn takes max_output_tokens as it is (the chat door checks it)
        if body.max_output_tokens is not None and self.num_output_tokens:
            max_tokens = body.max_output_tokens - self.num_output_tokens
            if max_tokens <= 0:
                self.out_of_tokens = True
                return None
        choice: str | dict[str, Any] | None = None
        if self.toolset and turn > 0:
            choice = "auto" if self.num_calls < self.max_calls else "none"
        elif self.toolset and self.num_calls >= self.max_calls:
            choice = "none"
        items = [*self.conversation, *self.events.items]
        chat = to_chat_request(body, items, self.toolset.functions(), choice, max_tokens)
        self.engine_request_id = self.response_id if turn == 0 else f"{self.response_id}-turn{turn}"
        self._turn_start = len(self.events.items)
        if turn > 0 and self.on_turn is not None:
            await self.on_turn()  # the store records this turn's engine request: a cancel aborts it
        _, stream = await start_chat(
            chat, self.request, self.serving, in_order=True, request_id=self.engine_request_id
        )
        return stream

    @property
    def _turn_items(self) -> list[dict[str, Any]]:
        return self.events.items[self._turn_start :]

    def _count(self, state: RequestState) -> None:
        self.state = state
        self.num_prompt_tokens += len(state.prompt_token_ids)
        self.num_cached_tokens += state.num_cached_tokens
        self.num_output_tokens += state.num_output_tokens

    async def _run_pending(self, complete: bool = True) -> AsyncIterator[bytes]:
        """Run the calls the last turn made (complete: it ended by a stop, not by max_output_tokens or an
        abort, so their arguments are whole)."""
        events = self.events
        pending, events.pending = events.pending, []
        for index in pending:
            item = events.items[index]
            server, _ = self.toolset.by_name.get(item["name"], (None, None))
            if server is not None and server.ref.label != item["server_label"]:
                server = None  # an approval for another server's tool of that name
            if not complete:
                message = "not run: the output ended before the call did"
                result = CallResult(error={"type": "mcp_protocol_error", "code": -32000, "message": message})
            elif self.num_calls >= self.max_calls:
                message = f"not run: this response reached max_tool_calls ({self.max_calls})"
                result = CallResult(error={"type": "mcp_protocol_error", "code": -32000, "message": message})
            elif server is None:
                message = f"MCP server {item['server_label']!r} has no tool {item['name']!r} in this request"
                result = CallResult(error={"type": "mcp_protocol_error", "code": -32601, "message": message})
            else:
                self.num_calls += 1
                result = await call_tool(
                    server.ref, item["name"], item["arguments"], self.serving.tool_servers.timeout_s
                )
            status = "completed" if result.error is None else "failed" if complete else "incomplete"
            fields = {"output": result.output, "error": result.error, "status": status}
            for event in events.finish(index, fields, result.error is not None):
                yield event
