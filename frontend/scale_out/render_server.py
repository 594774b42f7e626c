"""`engine launch render MODEL`: an API server with the model's tokenizer and chat template and no engine
(vLLM's render server, for a router that renders on CPUs apart from its engines). It answers the render
doors (frontend/scale_out/render.py), /tokenize and /detokenize, /v1/models, /health and /metrics; the doors
that generate are absent (404). No weights are read: the context length and vocabulary come from the
checkpoint's config.json or the GGUF file's header."""

from __future__ import annotations

import json
import os
from typing import Any

from protocol.messages import ModelInfo
from protocol.version import __version__


class NoEngine:
    """The engine client of a frontend without an engine: never dead, never loaded, nothing open. The
    doors that would send it a request are not mounted, so it refuses any that arrives."""

    dead_reason: str | None = None
    is_dead = False
    last_stats = None
    engine_stats: list[Any] = [None]
    num_open_requests = 0
    added_since_stats = 0

    def stalled_for(self) -> float:
        return 0.0

    def engine_index(self, request_id: str) -> int:
        return 0

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this server renders only: it has no engine to run requests on")

    async def abort(self, request_ids: list[str], reason: str | None = None) -> None:
        return None

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        return None

    def release(self, request_id: str) -> None:
        return None

    async def abort_all(self, reason: str) -> int:
        return 0

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        raise RuntimeError(f"this server renders only: no engine answers {method}")

    def mark_dead(self, reason: str) -> None:
        return None

    def close(self) -> None:
        return None


def render_model_info(model: str, served_names: list[str], max_model_len: int | None, tokenizer: Any,
                      structured_outputs_backend: str) -> ModelInfo:  # fmt: skip
    """What the render doors need of a model, read from its files (no weights): the context length (the
    flag's, else the checkpoint's) and the vocabulary size."""
    context, vocab = gguf_sizes(model) if model.endswith(".gguf") else config_sizes(model)
    if vocab is None and tokenizer is not None:
        vocab = len(tokenizer)
    if max_model_len is None and context is None:
        raise ValueError(f"{model} names no context length: pass --max-model-len")
    if vocab is None:
        raise ValueError(f"{model} names no vocabulary size and has no tokenizer")
    return ModelInfo(
        model=model,
        served_model_names=served_names or [model],
        max_model_len=int(max_model_len or context),  # type: ignore[arg-type]
        block_size=16,
        vocab_size=int(vocab),
        eos_token_ids=[],
        dtype="",
        num_kv_blocks=0,
        engine_version=__version__,
        structured_outputs_backend=structured_outputs_backend,
    )


def config_sizes(folder: str) -> tuple[int | None, int | None]:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None, None
    text = config.get("text_config") or config  # a vision-language checkpoint's language model
    context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return context, text.get("vocab_size") or config.get("vocab_size")


def gguf_sizes(path: str) -> tuple[int | None, int | None]:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    return value(f"{arch}.context_length"), vocab


def launch_render(engine_args: Any, args: Any) -> int:
    """`engine launch render`: the flags checked, the tokenizer loaded, then one API server in this process
    (the render doors need no engine, so nothing else starts)."""
    import msgspec
    import uvloop

    from frontend.config.flags import ConfigError
    from frontend.launcher import server_config
    from frontend.model_files import load_tokenizer, resolve_model
    from frontend.server.listen import bind_http_socket, bind_unix_socket
    from frontend.server.main import run_app
    from protocol.startup import StartupPhases
    from structured_outputs.registry import resolve_backend_name

    phases = StartupPhases("render server")
    phases.mark("imports")
    if args.tokens_only:
        raise ConfigError("--tokens-only", "a render server has no engine to generate with")
    if args.api_server_count != 1:
        raise ConfigError("--api-server-count", "a render server is one process")
    try:
        backend = resolve_backend_name(engine_args.structured_outputs_config.get("backend", "auto"))
    except ValueError as error:
        raise ConfigError("--structured-outputs-config", str(error)) from None
    model = resolve_model(engine_args.model, engine_args.revision, engine_args.download_dir)
    tokenizer_path = engine_args.resolved_tokenizer() or model
    config = msgspec.structs.replace(server_config(engine_args, args, model, "", ""), render_only=True,
                                     tokenizer=tokenizer_path)  # fmt: skip
    sock = bind_unix_socket(args.uds) if args.uds else bind_http_socket(args.host, args.port)
    phases.mark("config")
    tokenizer = load_tokenizer(tokenizer_path, engine_args.cache_dir)  # transformers' import: most of it
    if tokenizer is None:
        raise ConfigError("--tokenizer", f"{tokenizer_path} has no tokenizer to render with")
    try:
        info = render_model_info(model, engine_args.served_model_name or [engine_args.model], engine_args.max_model_len,
                                 tokenizer, backend)  # fmt: skip
    except ValueError as error:
        raise ConfigError("--max-model-len", str(error)) from None
    phases.mark("tokenizer and model files")
    where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
    print(f"engine: rendering for {info.served_model_names[0]} on {where} (no engine)", flush=True)
    try:
        uvloop.run(run_app(config, sock, phases, NoEngine(), tokenizer, info))
    finally:
        if args.uds and os.path.exists(args.uds):
            os.unlink(args.uds)
    return 0
