"""The `engine` command: `serve` (the OpenAI-compatible server), `chat` and `complete` (clients of a
running server), `generate` (offline)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from protocol.config import DEFAULT_BLOCK_SIZE
from protocol.log_format import configure_logging
from protocol.version import __version__

# The step's token budget when serving: short prefill chunks let a burst's first requests start decoding
# while the rest are prefilled, instead of the whole burst waiting for one long step (served c=16 TTFT
# p50 about halved against 2,048 at the same throughput, docs/performance.md). Offline commands keep
# the larger budget, which prefills a long prompt in fewer steps.
SERVE_MAX_NUM_BATCHED_TOKENS = 256


def add_engine_args(parser: argparse.ArgumentParser, max_num_batched_tokens: int = 2048) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="requests running at once")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=max_num_batched_tokens,
        help=f"token budget of one step (default {max_num_batched_tokens})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size in GiB")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides the above)"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV of shared prefixes",
    )
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule each step while the one before it runs, so the worker never waits for the engine "
        "(default on)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="cpu: the csrc kernels (attention and fused layers); torch: the plain reference; auto: cpu if built",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="the worker's torch intra-op threads (default: torch's, one per core)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one JSON object a line"
    )
    parser.add_argument(
        "--stats-log-interval", type=float, default=10.0, help="seconds between engine summary lines (0: off)"
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gb * (1 << 30)),
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        seed=args.seed,
        log_level=args.log_level,
        log_format=args.log_format,
        stats_log_interval_s=args.stats_log_interval,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from frontend.llm import LLM
    from protocol.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        n=args.n,
        stop=args.stop or [],
    )
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            results = llm.generate(args.prompt, params)
    for result in results:
        for output in result.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": result.prompt,
                            "index": output.index,
                            "text": output.text,
                            "finish_reason": output.finish_reason,
                            "num_tokens": len(output.token_ids),
                        }
                    )
                )
            else:
                print(output.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from frontend.launcher import serve

    return serve(args, engine_kwargs(args))


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve a model over the OpenAI API (HTTP + SSE)")
    add_engine_args(serve, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-server-count", type=int, default=1, help="API-server processes sharing the port"
    )
    serve.add_argument(
        "--served-model-name", nargs="+", default=None, help="names the API accepts as `model`"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require `Authorization: Bearer KEY` (repeatable; also ENGINE_API_KEY, comma-separated)",
    )
    serve.add_argument("--api-key-file", default=None, help="a file of API keys, one a line")
    serve.add_argument(
        "--max-request-body-mb", type=float, default=16.0, help="larger request bodies get 413"
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=0,
        help="503 when this many wait in the engine (0: no limit)",
    )
    serve.add_argument(
        "--max-queued-tokens", type=int, default=0, help="503 when this many prompt tokens wait (0: no limit)"
    )
    serve.add_argument(
        "--max-inflight-requests", type=int, default=0, help="429 when one API server has this many open"
    )
    serve.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="SIGTERM: seconds open requests may finish"
    )
    serve.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=120.0,
        help="/health is 503 when requests are open and the engine made no step for this long",
    )
    serve.add_argument(
        "--engine-connect-timeout",
        type=float,
        default=600.0,
        help="seconds an API server waits for the engine to answer (model loading included)",
    )
    serve.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json")
    serve.add_argument(
        "--allow-remote-engine",
        action="store_true",
        help="let --engine-address bind a TCP address other than loopback (the engine has no auth)",
    )
    serve.add_argument("--allowed-origins", action="append", default=None, help="CORS origin (repeatable)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    serve.add_argument(
        "--engine-address", default=None, help="where the engine binds: tcp://HOST:PORT or ipc://PATH"
    )
    serve.add_argument(
        "--headless", action="store_true", help="run the engine and workers only (needs --engine-address)"
    )
    serve.add_argument(
        "--attach", default=None, help="run API servers only, joining the engine at this address"
    )
    serve.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for unset request fields: 'auto' (the model's generation_config.json), 'vllm' (none), or a folder",
    )
    serve.add_argument("--disable-log-requests", action="store_true", help="no per-request debug log lines")
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="An OpenAI-compatible LLM inference server.")
    parser.add_argument("--version", action="version", version=f"engine {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    from frontend.cli_clients import add_client_parsers

    add_client_parsers(commands)
    from frontend.bench_serve import add_bench_parser

    add_bench_parser(commands)
    generate = commands.add_parser("generate", help="generate offline for prompts given on the command line")
    add_engine_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    generate.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--n", type=int, default=1)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.add_argument("--json", action="store_true", help="one JSON object per completion")
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
