"""system_fingerprint: the `system_fingerprint` of every chat and completion body and chunk, computed
once per API server (vLLM's --fingerprint-mode).

It names what decides the outputs: the engine's version, the model and engine settings the engine
reports (ModelInfo), and this server's settings that change outputs (chat template, generation
config, tokenizer, parsers). Every API server of one `engine serve`, and a frontend attached to the
same engine with the same settings, gives the same value; ports, keys and the server's index are left
out so that they do.

Modes: full `engine-<version>-<dtype>-<hash8>`, hash `engine-<version>-<hash8>`, custom (the given
string), none (null).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from protocol.messages import ModelInfo

# ServerConfig fields that change what a request's output is
OUTPUT_SETTINGS = (
    "chat_template",
    "generation_config",
    "tokenizer",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "tool_parser_plugin",
    "reasoning_parser",
)


def config_hash(model_info: ModelInfo, settings: dict[str, Any]) -> str:
    """8 hex digits of a SHA-256 over the engine's ModelInfo and the output settings, in a canonical
    JSON (sorted keys), so equal configurations hash equal in any process."""
    engine = {name: getattr(model_info, name) for name in model_info.__struct_fields__}
    document = msgspec.json.encode({"engine": engine, "server": settings}, order="sorted")
    return hashlib.sha256(document).hexdigest()[:8]


def system_fingerprint(
    mode: str, model_info: ModelInfo, settings: dict[str, Any], custom_value: str | None = None
) -> str | None:
    if mode == "none":
        return None
    if mode == "custom":
        return custom_value
    digest = config_hash(model_info, settings)
    if mode == "hash":
        return f"engine-{model_info.engine_version}-{digest}"
    if mode == "full":
        return f"engine-{model_info.engine_version}-{model_info.dtype}-{digest}"
    raise ValueError(f"fingerprint mode must be full, hash, custom or none, got {mode!r}")


def output_settings(config: Any) -> dict[str, Any]:
    """The ServerConfig fields the fingerprint covers."""
    return {name: getattr(config, name) for name in OUTPUT_SETTINGS}
