"""What an API server's routes depend on, in one typed object (FastAPI reads it from app.state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from frontend.engine.client import AsyncEngineClient
from frontend.metrics import EngineStatsCollector, Metrics
from frontend.openai.serving import OpenAIServing


class ServerConfig(msgspec.Struct, kw_only=True):
    """What the launcher tells each API server (as JSON on its stdin)."""

    model: str  # path, for the tokenizer; "" takes the model the engine reports
    input_address: str
    output_address: str
    server_index: int = 0
    api_keys: list[str] = []  # any of them opens the API; empty: no key needed
    chat_template: str | None = None  # a template string (the launcher reads --chat-template files)
    allowed_origins: list[str] = []
    tokenizer_cache_dir: str | None = None
    log_level: str = "warning"
    register_timeout_s: float = 600.0
    generation_config: str = "auto"  # "auto" (the model's generation_config.json), "vllm" (none) or a folder
    log_format: str = "text"
    log_requests: bool = True  # per-request lines at debug level
    max_request_body_bytes: int = 16 << 20  # larger bodies get 413 before they are parsed
    max_queued_requests: int = 0  # admission control, 0 = none (see AdmissionLimits)
    max_queued_tokens: int = 0
    max_inflight_requests: int = 0
    shutdown_timeout_s: float = 30.0  # SIGTERM: open requests may finish this long, then are aborted
    engine_stall_timeout_s: float = 120.0  # open requests and no engine step this long: /health 503
    enable_docs: bool = True  # /docs, /redoc and /openapi.json
    metrics_prefix: str = "engine"  # or "vllm", for dashboards made for vLLM
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (with a tool_call_parser)
    tool_call_parser: str | None = None  # the model's tool-call format (frontend/parsers/)
    tool_parser_plugin: str | None = None  # a file adding tool parsers
    reasoning_parser: str | None = None  # splits <think> sections into `reasoning`


@dataclass
class AppDeps:
    config: ServerConfig
    serving: OpenAIServing
    metrics: Metrics | None = None
    stats_collector: EngineStatsCollector = field(init=False)

    def __post_init__(self) -> None:
        client = self.serving.client
        self.stats_collector = EngineStatsCollector(
            lambda: client.last_stats,
            self.serving.model_info.served_model_names[0],
            prefix=self.config.metrics_prefix,
        )

    @property
    def client(self) -> AsyncEngineClient:
        return self.serving.client
