"""BatchArgs: the knobs of `engine run-batch` beyond the engine's (fields -> flags), and which of
ServerArgs' knobs it takes too (the ones that shape answers; none of the HTTP socket's)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from frontend.config.flags import ConfigError, option

# ServerArgs fields that mean something to the in-process app of `engine run-batch`
SERVER_FIELDS = (
    "chat_template",
    "generation_config",
    "enable_log_requests",
    "max_request_body_mb",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "tool_parser_plugin",
    "reasoning_parser",
    "max_log_len",
    "enable_force_include_usage",
    "response_role",
    "fingerprint_mode",
    "fingerprint_value",
)


@dataclass(frozen=True)
class BatchArgs:
    input_file: str | None = option(
        None,
        "the batch file, one request a line (OpenAI's batch input format); a local path",
        aliases=[("-i", str, "the same as --input-file")],
    )
    output_file: str | None = option(
        None,
        "where one result a line goes, in the input's order (OpenAI's batch output format); a local path",
        aliases=[("-o", str, "the same as --output-file")],
    )
    max_concurrency: int | None = option(
        None, "lines in flight at once (default: twice --max-num-seqs, as vLLM's run-batch)"
    )
    progress_bar: bool = option(True, "a progress bar on stderr, when stderr is a terminal")

    def __post_init__(self) -> None:
        for flag, path in (("--input-file (-i)", self.input_file), ("--output-file (-o)", self.output_file)):
            if not path:
                raise ConfigError(flag, "required")
            if path.startswith(("http://", "https://")):
                raise ConfigError(flag, f"only local paths are supported, got {path!r}")
        assert self.input_file is not None and self.output_file is not None
        if os.path.realpath(self.input_file) == os.path.realpath(self.output_file):
            raise ConfigError("--output-file (-o)", "must not be the input file")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("--max-concurrency", f"must be at least 1, got {self.max_concurrency}")

    def concurrency(self, max_num_seqs: int) -> int:
        return self.max_concurrency or 2 * max_num_seqs
