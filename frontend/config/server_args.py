"""ServerArgs: the knobs of `engine serve` beyond the engine's, written once (fields -> flags)."""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass

from frontend.config.flags import ConfigError, option
from frontend.config.tool_server import allowed_url, tool_server_url
from frontend.vision.limits import parse_mm_limits

# The step's token budget when serving: short prefill chunks let a burst's first requests start decoding
# while the rest are prefilled, instead of the whole burst waiting for one long step (served c=16 TTFT
# p50 about halved against 2,048 at the same throughput,
# benchmarks/results/2026-11-29-lab-notes-performance.md, "Where a step goes now"). Offline commands keep
# the larger budget, which prefills a long prompt in fewer steps.
SERVE_MAX_NUM_BATCHED_TOKENS = 256
# While requests decode, a served step carries at most this many prefill tokens, so that an inter-token
# gap holds 64 tokens of prefill, not 256. Served c=16, 48 requests of 100 in / 64 out, float32, 3 rounds
# alternating (AMD EPYC, AVX2 only, 2026-12-01): ITL p99 653-709 -> 190-312 ms, TTFT p50 1.24-1.47 ->
# 0.62-0.83 s, throughput level; 32 kept ITL p99 at 206-214 ms but raised ITL p50 from 73 to 110-118 ms
# (benchmarks/results/2026-12-01-lab-notes-issue25.md, "A step's prefill share").
SERVE_DECODE_PREFILL_TOKEN_BUDGET = 64
# On a CPU with AVX-512 BF16 and no AMX (the Zen 4 EPYC), where 64 tokens made a c=16 step's ITL p99 1.25x
# vLLM's, half of that, growing one token per request the engine holds: c=16 ITL p99 61-71 -> 44-49 ms at
# the same output, c=64 as before (64 requests held: 64 tokens), a burst's ramp fed (2026-12-07,
# benchmarks/results/2026-12-07-lab-notes-speech-attention-zen4.md, "A smaller prefill share at c=16"). The
# Xeon met vLLM's c=16 ITL p99 with 64 (run U), and on the AVX2 EPYC 32 raised ITL p50 (above): both keep it.
ZEN4_DECODE_PREFILL_SHARE = (32, 1)


def serve_prefill_share(cpuinfo_path: str = "/proc/cpuinfo") -> tuple[int, int]:
    """`engine serve`'s (decode_prefill_token_budget, decode_prefill_tokens_per_request) on this CPU."""
    flags: set[str] = set()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    if "avx512_bf16" in flags and "amx_bf16" not in flags:
        return ZEN4_DECODE_PREFILL_SHARE
    return SERVE_DECODE_PREFILL_TOKEN_BUDGET, 0


API_KEY_ENV = ("ENGINE_API_KEY", "VLLM_API_KEY")  # read in this order, comma-separated keys each
# `/server_info` is served when either is 1 (vLLM's VLLM_SERVER_DEV_MODE, and ours); read by the launcher
DEV_MODE_ENV = ("ENGINE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")
# /v1/load_lora_adapter and /v1/unload_lora_adapter are served when either is true (vLLM's and ours)
RUNTIME_LORA_ENV = ("ENGINE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
FINGERPRINT_MODES = ["full", "hash", "custom", "none"]
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def origins(text: str) -> list[str]:
    """An --allowed-origins value: one origin, or vLLM's JSON list of them."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON list: {error}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("expected a JSON list of strings, e.g. '[\"https://a.example\"]'")
        return values
    return [text]


@dataclass(frozen=True)
class ServerArgs:
    host: str = option("127.0.0.1", "interface to listen on")
    port: int = option(8000, "HTTP port")
    uds: str | None = option(
        None, "listen on this Unix domain socket path instead (--host and --port unused)"
    )
    api_server_count: int = option(1, "API-server processes sharing the port")
    grpc: bool = option(
        False, "serve vLLM's gRPC service (vllm.grpc.engine.VllmEngine, health, reflection) on --port instead "
        "of HTTP (docs/grpc.md)",
    )  # fmt: skip
    api_key: list[str] = option(
        default_factory=list,
        help="require `Authorization: Bearer KEY` or `x-api-key: KEY`; also ENGINE_API_KEY or VLLM_API_KEY, "
        "comma-separated",
    )
    api_key_file: str | None = option(None, "a file of API keys, one a line")
    allowed_origins: list[str] = option(
        default_factory=list, help="CORS origin, or a JSON list of them (vLLM's form)", parse=origins
    )
    max_request_body_mb: float = option(16.0, "larger request bodies get 413")
    max_queued_requests: int = option(0, "503 when this many wait in the engine (0: no limit)")
    max_queued_tokens: int = option(0, "503 when this many prompt tokens wait (0: no limit)")
    max_inflight_requests: int = option(0, "429 when one API server has this many open (0: no limit)")
    shutdown_timeout_s: float = option(
        30.0, "SIGTERM: seconds open requests may finish", flag="--shutdown-timeout"
    )
    engine_stall_timeout_s: float = option(
        120.0,
        "/health is 503 when requests are open and the engine made no step for this long",
        flag="--engine-stall-timeout",
    )
    engine_heartbeat_timeout_s: float = option(
        10.0,
        "an API server judges the engine gone after this many seconds without a word from it (it speaks "
        "every second): open requests fail and /health is 503 until it speaks again",
        flag="--engine-heartbeat-timeout",
    )
    engine_connect_timeout_s: float = option(
        600.0,
        "seconds an API server waits for the engine to answer (model loading included)",
        flag="--engine-connect-timeout",
    )
    enable_fastapi_docs: bool = option(
        True,
        "/docs, /redoc and /openapi.json",
        aliases=[("--disable-fastapi-docs", False, "the same as --no-enable-fastapi-docs")],
    )
    allow_remote_engine: bool = option(
        False, "let --engine-address bind a TCP address other than loopback (the engine has no auth)"
    )
    chat_template: str | None = option(None, "a Jinja chat template, or a file holding one")
    engine_address: str | None = option(None, "where the engine binds: tcp://HOST:PORT or ipc://PATH")
    headless: bool = option(False, "run the engine and workers only (needs --engine-address)")
    attach: str | None = option(None, "run API servers only, joining the engine at this address")
    generation_config: str = option(
        "auto",
        "sampling defaults for unset request fields: 'auto' (the model's generation_config.json), 'vllm' "
        "(none), or a folder",
    )
    enable_log_requests: bool = option(
        True,
        "per-request debug log lines",
        aliases=[("--disable-log-requests", False, "the same as --no-enable-log-requests")],
    )
    metrics_prefix: str = option(
        "engine",
        "prefix of every Prometheus family: vllm serves dashboards made for vLLM",
        choices=["engine", "vllm"],
    )

    enable_auto_tool_choice: bool = option(
        False, 'let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser'
    )
    tool_call_parser: str | None = option(None, "the model's tool-call format: hermes, or a plugin's name")
    tool_parser_plugin: str | None = option(None, "a Python file defining TOOL_PARSERS = {name: class}")
    reasoning_parser: str | None = option(
        None, "split <think> sections into message.reasoning: deepseek_r1 or qwen3"
    )
    responses_store_max_count: int = option(
        10000, "stored /v1/responses kept at most, least recently used evicted first (0: no store)"
    )
    responses_store_max_mb: float = option(256.0, "and at most this much of them (their JSON)")
    tool_server: str | None = option(
        None, "MCP servers a /v1/responses mcp tool names by server_label: host:port,... (their /sse, as "
        "vLLM's flag) or http(s) URLs (a path ending /sse: SSE, else streamable HTTP)",
    )  # fmt: skip
    mcp_allowed_urls: list[str] = option(
        default_factory=list, help="MCP server URLs a request's mcp tool may name in server_url: an origin "
        "(scheme://host:port, any path) or one URL (none without this flag)", nargs="+",
    )  # fmt: skip
    mcp_timeout_s: float = option(
        30.0, "seconds an MCP server has to list its tools or answer one call", flag="--mcp-timeout"
    )

    # images (docs/vision.md)
    allowed_local_media_path: str | None = option(
        None, "image parts may read file:// URLs under this directory (none without it)"
    )
    allowed_media_domains: list[str] = option(
        default_factory=list, help="image URLs only from these hosts (exact names; every redirect checked)",
        nargs="+",
    )  # fmt: skip
    limit_mm_per_prompt: dict[str, int] = option(
        default_factory=dict, help='the most images a prompt may hold, vLLM\'s JSON: \'{"image": 2}\' (default 999)',
        parse=parse_mm_limits,
    )  # fmt: skip
    mm_processor_cache_gb: float = option(
        4.0, "GiB of processed images each API server keeps, by content hash or uuid (0: none)"
    )

    # scale-out (docs/scale-out.md)
    enable_tokenizer_info_endpoint: bool = option(
        False, "serve GET /tokenizer_info: the tokenizer's config and the chat template"
    )
    tokens_only: bool = option(
        False, "serve token ids only: /inference/v1/generate and /abort_requests, no tokenizer loaded"
    )

    # vLLM's server options (docs/server-options.md)
    ssl_keyfile: str | None = option(None, "serve HTTPS with this private key (with --ssl-certfile)")
    ssl_certfile: str | None = option(None, "serve HTTPS with this certificate chain (with --ssl-keyfile)")
    ssl_ca_certs: str | None = option(None, "CA certificates to verify client certificates against")
    ssl_cert_reqs: int = option(
        int(ssl.CERT_NONE), "client certificates: 0 none, 1 optional, 2 required (the ssl module's CERT_*)"
    )
    enable_ssl_refresh: bool = option(
        False, "reload the key, certificate and CA files when they change, without a restart"
    )
    root_path: str | None = option(
        None, "the path prefix a reverse proxy serves us under (FastAPI's root_path)"
    )
    uvicorn_log_level: str | None = option(
        None, "log level of uvicorn's loggers (default: --log-level)", choices=UVICORN_LOG_LEVELS
    )
    enable_uvicorn_access_log: bool = option(
        True,
        "uvicorn's one line per HTTP request",
        aliases=[("--disable-uvicorn-access-log", False, "the same as --no-enable-uvicorn-access-log")],
    )
    middleware: list[str] = option(
        default_factory=list,
        help="an ASGI middleware to add, as module.name: a class (app.add_middleware) or an async function "
        "(an HTTP middleware)",
    )
    max_log_len: int | None = option(
        None, "request logs show at most this many prompt characters and token ids (default: all)"
    )
    response_role: str = option(
        "assistant", "the role of chat answers (with add_generation_prompt false: the last message's role)"
    )
    enable_force_include_usage: bool = option(
        False, "usage in every streamed response, as if stream_options.include_usage were set"
    )
    fingerprint_mode: str = option(
        "full",
        "system_fingerprint of responses: full (engine-VERSION-DTYPE-HASH), hash (engine-VERSION-HASH), "
        "custom (--fingerprint-value), none (null)",
        choices=FINGERPRINT_MODES,
        aliases=[("--fingerprint", str, "the same as --fingerprint-mode")],
    )
    fingerprint_value: str | None = option(None, "the system_fingerprint with --fingerprint-mode custom")

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice", "needs --tool-call-parser")
        if self.fingerprint_mode not in FINGERPRINT_MODES:  # the --fingerprint spelling is not checked
            modes = ", ".join(FINGERPRINT_MODES)
            raise ConfigError("--fingerprint-mode", f"takes {modes}, got {self.fingerprint_mode!r}")
        if self.fingerprint_mode == "custom" and not self.fingerprint_value:
            raise ConfigError("--fingerprint-mode", "custom needs --fingerprint-value")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            given = "--ssl-keyfile" if self.ssl_keyfile else "--ssl-certfile"
            raise ConfigError(given, "HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError("--ssl-cert-reqs", f"takes 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.root_path is not None and self.root_path and not self.root_path.startswith("/"):
            raise ConfigError("--root-path", f"must start with '/', got {self.root_path!r}")
        if self.grpc:
            http_only: tuple[tuple[str, object], ...] = (
                ("--uds", self.uds), ("--ssl-certfile", self.ssl_certfile), ("--middleware", self.middleware),
                ("--root-path", self.root_path),
            )  # fmt: skip
            for flag, value in http_only:
                if value:
                    raise ConfigError(
                        flag, "is for the HTTP server; --grpc serves plaintext gRPC on --host:--port"
                    )
        for spec in self.tool_servers:
            try:
                tool_server_url(spec)
            except ValueError as error:
                raise ConfigError("--tool-server", str(error)) from None
        for url in self.mcp_allowed_urls:
            if not allowed_url(url):
                raise ConfigError("--mcp-allowed-urls", f"takes http(s) URLs, got {url!r}")
        if self.mcp_timeout_s <= 0:
            raise ConfigError("--mcp-timeout", f"must be more than 0, got {self.mcp_timeout_s}")
        if self.engine_heartbeat_timeout_s < 2:
            raise ConfigError(
                "--engine-heartbeat-timeout",
                f"must be 2 or more (the engine speaks once a second), got {self.engine_heartbeat_timeout_s}",
            )
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError("--max-log-len", f"must be 0 or more, got {self.max_log_len}")

    @property
    def tool_servers(self) -> list[str]:
        return [spec.strip() for spec in (self.tool_server or "").split(",") if spec.strip()]

    @staticmethod
    def dev_mode(environ: dict[str, str] | None = None) -> bool:
        """ENGINE_SERVER_DEV_MODE=1 or VLLM_SERVER_DEV_MODE=1: developer endpoints (/server_info)."""
        return _env_true(DEV_MODE_ENV, environ)

    @staticmethod
    def runtime_lora_updating(environ: dict[str, str] | None = None) -> bool:
        """ENGINE_ALLOW_RUNTIME_LORA_UPDATING or VLLM_ALLOW_RUNTIME_LORA_UPDATING true: load and unload
        LoRA adapters over HTTP."""
        return _env_true(RUNTIME_LORA_ENV, environ)

    def api_keys(self, environ: dict[str, str] | None = None) -> list[str]:
        """Keys from --api-key (repeatable), --api-key-file (one a line, # comments), ENGINE_API_KEY and
        VLLM_API_KEY (comma-separated)."""
        environ = dict(os.environ) if environ is None else environ
        keys = list(self.api_key)
        if self.api_key_file:
            with open(self.api_key_file) as f:
                keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        for name in API_KEY_ENV:
            keys += [key.strip() for key in environ.get(name, "").split(",") if key.strip()]
        return list(dict.fromkeys(keys))


def _env_true(names: tuple[str, ...], environ: dict[str, str] | None) -> bool:
    environ = dict(os.environ) if environ is None else environ
    return any(environ.get(name, "").strip().lower() in ("1", "true") for name in names)
