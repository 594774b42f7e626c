"""Text parsers over a choice's output: reasoning sections and tool calls (frontend/parsers/README)."""
