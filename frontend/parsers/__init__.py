"""Text parsers over a choice's output: reasoning sections and tool calls (see README.md here)."""
