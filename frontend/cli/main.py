"""The `engine` command: `serve` (the OpenAI-compatible server), `chat` and `complete` (clients of a
running server), `generate` and `run-batch` (offline), `bench`, `collect-env` (for bug reports). Engine and server
flags come from EngineArgs and
ServerArgs (frontend.config): each knob is written once, there."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from frontend.config.engine_args import EngineArgs
from frontend.config.flags import ConfigError, add_flags, from_namespace
from frontend.config.server_args import SERVE_MAX_NUM_BATCHED_TOKENS, ServerArgs, serve_prefill_share
from protocol.log_format import configure_logging
from protocol.version import __version__


def engine_args_of(args: argparse.Namespace) -> EngineArgs:
    return from_namespace(EngineArgs, args)


def checked_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine's flags checked and its model and tokenizer found, before any process starts (raises
    ValueError, ConfigError or ModelNotFoundError: the operator's errors); the model and tokenizer come
    back resolved, so that the engine does not look them up again (a hub id, the default model)."""
    engine_args = engine_args_of(args)
    worker = engine_args.engine_config().worker
    return dataclasses.replace(
        engine_args,
        model=worker.model,
        tokenizer=worker.tokenizer,
        served_model_name=worker.served_model_names,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from frontend.model_files import ModelNotFoundError
    from frontend.offline.llm import LLM
    from protocol.sampling import SamplingParams

    try:  # a bad flag or a missing model: one line, as `serve` says it
        engine_args = checked_engine_args(args)
    except (ValueError, ModelNotFoundError) as error:
        return usage_error("generate", error)

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        n=args.n,
        stop=args.stop or [],
    )
    with LLM.from_engine_args(engine_args) as llm:
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            results = llm.generate(args.prompt, params)
    for result in results:
        for output in result.outputs:
            if args.json:
                line = {
                    "prompt": result.prompt,
                    "index": output.index,
                    "text": output.text,
                    "finish_reason": output.finish_reason,
                    "num_tokens": len(output.token_ids),
                }
                print(json.dumps(line))
            else:
                print(output.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from frontend.launcher import serve
    from frontend.model_files import ModelNotFoundError

    # A bad flag, parser, file or model is the operator's: one line, no traceback. Any other error, and any
    # error once a process has started, stays a traceback.
    try:  # the config classes: every ValueError there is a bad flag value
        engine_args, server_args = engine_args_of(args), from_namespace(ServerArgs, args)
    except ValueError as error:
        return usage_error("serve", error)
    try:  # serve() runs its checks, which raise these, before it starts any process
        return serve(engine_args, server_args)
    except (ConfigError, ModelNotFoundError) as error:
        return usage_error("serve", error)


def usage_error(command: str, error: Exception) -> int:
    """argparse's form for a bad flag: `engine COMMAND: error: ...`, one line on stderr, exit status 2."""
    print(f"engine {command}: error: {error}", file=sys.stderr)
    return 2


def cmd_collect_env(args: argparse.Namespace) -> int:
    from frontend.collect_env import main as collect_env

    return collect_env(as_json=args.json)


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve a model over the OpenAI API (HTTP + SSE)")
    budget, per_request = serve_prefill_share()
    serve_defaults = {
        "max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS,
        "decode_prefill_token_budget": budget,
        "decode_prefill_tokens_per_request": per_request,
    }
    add_flags(serve, EngineArgs, defaults=serve_defaults)
    add_flags(serve, ServerArgs)
    serve.set_defaults(func=cmd_serve)


# the engine flags a render server reads: the model's files, its names and context length, the grammar
# backend its structured outputs are checked with, logging
RENDER_ENGINE_FLAGS = ("model", "revision", "tokenizer", "tokenizer_revision", "download_dir", "served_model_name",
                       "max_model_len", "cache_dir", "structured_outputs_config", "log_level", "log_format")  # fmt: skip


def cmd_launch_render(args: argparse.Namespace) -> int:
    from frontend.model_files import ModelNotFoundError
    from frontend.scale_out.render_server import launch_render

    try:
        engine_args, server_args = engine_args_of(args), from_namespace(ServerArgs, args)
    except ValueError as error:
        return usage_error("launch render", error)
    try:
        return launch_render(engine_args, server_args)
    except (ConfigError, ModelNotFoundError) as error:
        return usage_error("launch render", error)


def add_launch_parser(commands: Any) -> None:
    launch = commands.add_parser("launch", help="launch a server for one part of a scale-out deployment")
    parts = launch.add_subparsers(dest="part", required=True)
    render = parts.add_parser(
        "render",
        help="a render-only server: chat and completions to token ids, no engine (docs/scale-out.md)",
    )
    add_flags(render, EngineArgs, only=RENDER_ENGINE_FLAGS)
    add_flags(render, ServerArgs)
    render.set_defaults(func=cmd_launch_render)


def cmd_proxy(args: argparse.Namespace) -> int:
    from frontend.config.proxy_args import ProxyArgs
    from frontend.scale_out.proxy import run_proxy

    try:
        proxy_args = from_namespace(ProxyArgs, args)
    except ValueError as error:
        return usage_error("proxy", error)
    return run_proxy(proxy_args)


def add_proxy_parser(commands: Any) -> None:
    from frontend.config.proxy_args import ProxyArgs

    proxy = commands.add_parser(
        "proxy", help="route each request to a prefill and then a decode instance (docs/scale-out.md)"
    )
    add_flags(proxy, ProxyArgs)
    proxy.set_defaults(func=cmd_proxy)


def add_generate_parser(commands: Any) -> None:
    generate = commands.add_parser("generate", help="generate offline for prompts given on the command line")
    add_flags(generate, EngineArgs)
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


class Parser(argparse.ArgumentParser):
    """argparse without its completion of abbreviations (as vLLM's parser): `--headles` is not
    `--headless`, and a flag is its full name or a documented alias. Subcommands' parsers, nested ones
    too, are made by this class (argparse's add_subparsers makes them of the parent's type)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def add_collect_env_parser(commands: Any) -> None:
    collect_env = commands.add_parser(
        "collect-env", help="print versions, the CPU and its ISA flags, torch's build: for bug reports"
    )
    collect_env.add_argument("--json", action="store_true", help="one JSON object")
    collect_env.set_defaults(func=cmd_collect_env)


def add_bench_parser(commands: Any) -> None:
    from frontend.bench.cli import add_bench_parser as add

    add(commands)


def add_run_batch_parser(commands: Any) -> None:
    from frontend.batch.cli import add_run_batch_parser as add

    add(commands)


# the commands whose parser is built alone when the command line names them: `engine serve` does not
# import the benchmarks' and clients' modules (0.1 s of every start on a Zen 4); the others (the clients,
# --help, a misspelt command) build the whole parser
PARSERS = {"serve": add_serve_parser, "launch": add_launch_parser, "proxy": add_proxy_parser,
           "bench": add_bench_parser, "generate": add_generate_parser, "run-batch": add_run_batch_parser,
           "collect-env": add_collect_env_parser}  # fmt: skip


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `engine` parser; given the command line, only its command's (see PARSERS)."""
    parser = Parser(prog="engine", description="An OpenAI-compatible LLM inference server.")
    parser.add_argument("--version", action="version", version=f"engine {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in PARSERS:
        PARSERS[argv[0]](commands)
        return parser
    from frontend.cli.clients import add_client_parsers

    add_serve_parser(commands)
    add_launch_parser(commands)
    add_proxy_parser(commands)
    add_client_parsers(commands)
    add_bench_parser(commands)
    add_generate_parser(commands)
    add_run_batch_parser(commands)
    add_collect_env_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_format", "text"))
    from frontend.engine.process import EngineRefusedError
    from frontend.model_files import ModelNotFoundError

    try:
        return int(args.func(args))
    except (
        ConfigError,
        ModelNotFoundError,
        EngineRefusedError,
    ) as error:  # a bad flag or model of a command that does not
        return usage_error(args.command, error)  # say it itself (bench), found before any process starts


if __name__ == "__main__":
    sys.exit(main())
