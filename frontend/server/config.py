"""ServerConfig: what the launcher tells each API server. Its own module, so that the launcher does not
import the server's stack (FastAPI and the doors: ~1 s of every start)."""

from __future__ import annotations

import msgspec


class ServerConfig(msgspec.Struct, kw_only=True):
    """What the launcher tells each API server (as JSON on its stdin)."""

    model: str  # path, for the tokenizer; "" takes the model the engine reports
    input_address: str
    output_address: str
    server_index: int = 0
    api_keys: list[str] = []  # any of them opens the API; empty: no key needed
    chat_template: str | None = None  # a template string (the launcher reads --chat-template files)
    allowed_origins: list[str] = []
    cache_dir: str | None = None
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
    engine_heartbeat_timeout_s: float = 10.0  # no message from the engine this long: judged gone
    enable_docs: bool = True  # /docs, /redoc and /openapi.json
    metrics_prefix: str = "engine"  # or "vllm", for dashboards made for vLLM
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (with a tool_call_parser)
    tool_call_parser: str | None = None  # the model's tool-call format (frontend/parsers/)
    tool_parser_plugin: str | None = None  # a file adding tool parsers
    reasoning_parser: str | None = None  # splits <think> sections into `reasoning`
    responses_store_path: str = ":memory:"  # the launcher's SQLite file, shared by its API servers
    responses_store_max_count: int = 10000  # stored responses kept at most (LRU eviction); 0: no store
    responses_store_max_bytes: int = 256 << 20
    tool_servers: list[str] = []  # MCP servers a request's mcp tools name by label (--tool-server)
    mcp_allowed_urls: list[str] = []  # MCP server URLs a request may name itself (--mcp-allowed-urls)
    mcp_timeout_s: float = 30.0  # to list one server's tools or run one call
    tokenizer: str | None = None  # a tokenizer folder other than the model's (--tokenizer)
    ssl_keyfile: str | None = None  # HTTPS with both of these
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED
    enable_ssl_refresh: bool = False  # reload the files above when they change
    root_path: str = ""  # the prefix a reverse proxy serves us under
    uvicorn_log_level: str | None = None  # None: log_level
    uvicorn_access_log: bool = True
    middleware: list[str] = []  # import paths of ASGI middleware classes or HTTP middleware functions
    max_log_len: int | None = None  # prompt characters and ids in request logs; None: all
    response_role: str = "assistant"  # the role of chat answers (--response-role)
    force_include_usage: bool = False  # usage in every stream (--enable-force-include-usage)
    fingerprint_mode: str = "full"  # system_fingerprint: full, hash, custom or none
    fingerprint_value: str | None = None  # the custom one
    dev_mode: bool = False  # ENGINE_SERVER_DEV_MODE / VLLM_SERVER_DEV_MODE: /server_info
    # ENGINE_ALLOW_RUNTIME_LORA_UPDATING / VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter, /v1/unload_...
    runtime_lora_updating: bool = False
    # images (frontend/vision/): file:// under this folder only; http(s) from these hosts only (empty: any)
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] = []
    limit_mm_per_prompt: dict[str, int] = {}  # per modality (vLLM's default: 999)
    mm_processor_cache_gb: float = 4.0  # processed images each API server keeps
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's flag)
    control_address: str = ""  # the launcher's scale socket (--enable-elastic-ep); "" when attached
    grpc: bool = False  # a gRPC front door (frontend/grpc_door/) on grpc_host:grpc_port instead of HTTP
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    grpc_shared_port: bool = False  # several gRPC servers share the port (SO_REUSEPORT)
    tokens_only: bool = False  # the tokens-in/tokens-out doors alone, no tokenizer (--tokens-only)
    render_only: bool = False  # `engine launch render`: the render doors and no engine
    ready_file: str = ""  # the launcher's: created once this server serves (frontend/api_servers.py)


def say_ready(config: ServerConfig) -> None:
    """Leave the launcher's ready file (an API server that dies after this is started again)."""
    if config.ready_file:
        with open(config.ready_file, "w"):
            pass
