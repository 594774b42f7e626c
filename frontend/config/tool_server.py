"""--tool-server's entries (the MCP servers an operator trusts, docs/tool-calling.md) and
--mcp-allowed-urls' (the ones a request may name)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")


def tool_server_url(spec: str) -> str:
    """host:port (vLLM's form: its SSE endpoint, http://host:port/sse) or an http(s) URL."""
    if HOST_PORT.match(spec):
        return f"http://{spec}/sse"
    parts = urlsplit(spec)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"a tool server is host:port or an http(s) URL, got {spec!r}")
    return spec


def allowed_url(entry: str) -> bool:
    """An --mcp-allowed-urls entry: an http(s) origin or URL."""
    try:
        parts = urlsplit(entry)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number
        return False
