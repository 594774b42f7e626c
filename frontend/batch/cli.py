"""`engine run-batch MODEL -i requests.jsonl -o results.jsonl` (vLLM's `vllm run-batch`): the engine as
`engine serve` starts it, the API server's app in this process, every line of the file sent to the app's
door for its url.

The parser imports only the config; the engine, the app and tqdm load when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from frontend.config.batch_args import SERVER_FIELDS, BatchArgs
from frontend.config.engine_args import EngineArgs
from frontend.config.flags import ConfigError, add_flags, from_namespace
from frontend.config.server_args import ServerArgs


def add_run_batch_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "run-batch", help="answer a file of requests (OpenAI's batch format) offline, one result a line"
    )
    add_flags(parser, EngineArgs)
    add_flags(parser, ServerArgs, only=SERVER_FIELDS)
    add_flags(parser, BatchArgs)
    parser.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    try:
        batch = from_namespace(BatchArgs, args)
        server_args = from_namespace(ServerArgs, args)
        engine_args = from_namespace(EngineArgs, args)
    except ValueError as error:
        return _error(str(error))
    return run(engine_args, server_args, batch)


def run(engine_args: EngineArgs, server_args: ServerArgs, batch: BatchArgs) -> int:
    from frontend.batch.runner import run_batch
    from frontend.launcher import check_parsers, server_config
    from frontend.model_files import ModelNotFoundError
    from frontend.offline.llm import LLM
    from frontend.server.app import build_app
    from frontend.server.deps import AppDeps, build_serving

    assert batch.input_file is not None and batch.output_file is not None  # BatchArgs checked them
    # What can be wrong with the files or the flags stops us before the engine loads.
    try:
        open(batch.input_file, "rb").close()
    except OSError as error:
        return _error(f"cannot read {batch.input_file}: {error.strerror}")
    folder = os.path.dirname(os.path.abspath(batch.output_file))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return _error(f"cannot write {batch.output_file}: {folder} is not a writable folder")
    try:
        engine_config = engine_args.engine_config()  # the model and tokenizer resolved once, here
        check_parsers(server_args)
        # The app's config, its files read now; the engine's addresses follow once it has them.
        config = server_config(engine_args, server_args, engine_config.worker.model, "", "")
    except (ConfigError, ModelNotFoundError) as error:
        return _error(str(error))
    config.api_keys = []  # no socket to guard; ENGINE_API_KEY in the environment must not lock us out
    # The LLM is handed the folders found above, so it looks nothing up again (a hub id, the default).
    worker = engine_config.worker
    engine_args = dataclasses.replace(
        engine_args,
        model=worker.model,
        tokenizer=worker.tokenizer,
        served_model_name=worker.served_model_names,
    )
    started = time.monotonic()
    with LLM.from_engine_args(engine_args) as llm:
        config.input_address = llm.engine.config.input_address
        config.output_address = llm.engine.config.output_address
        serving = build_serving(config, llm.engine_llm, llm.model_info)
        app = build_app(AppDeps(config, serving))
        concurrency = batch.concurrency(engine_args.max_num_seqs)
        summary = llm.run(
            run_batch(app, batch.input_file, batch.output_file, concurrency, batch.progress_bar)
        )
        engine_alive = llm.engine.is_alive()
    print(
        f"engine run-batch: {summary.num_lines} lines, {summary.num_ok} answered, {summary.num_errors} "
        f"errors -> {batch.output_file} ({time.monotonic() - started:.1f} s)",
        file=sys.stderr,
    )
    if not engine_alive:
        print("engine run-batch: the engine process exited during the run", file=sys.stderr)
        return 1
    return 0


def _error(message: str) -> int:
    print(f"engine run-batch: error: {message}", file=sys.stderr)
    return 2
