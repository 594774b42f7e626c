"""One API-server process: FastAPI + uvicorn on the listening socket the launcher hands down.

`python -m frontend.server.main FD [PARENT_PID]` reads its ServerConfig as JSON on stdin; FD is the shared,
already-listening TCP socket (N processes accept on it, the kernel spreads the connections), or -1 for a
gRPC front door (config.grpc: frontend/grpc_door/server.py), which binds its port itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

import msgspec
import uvicorn

from frontend.engine.async_llm import AsyncLLM
from frontend.engine.data_parallel import connect_engines
from frontend.engine.output_processor import SHUTDOWN_REASON
from frontend.metrics import Metrics
from frontend.model_files import load_tokenizer
from frontend.openai.serving import OpenAIServing
from frontend.server.app import build_app
from frontend.server.config import say_ready
from frontend.server.deps import AppDeps, ServerConfig, build_serving
from frontend.server.tls import CertRefresher
from protocol.log_format import configure_logging
from protocol.startup import StartupPhases, exit_with_parent

logger = logging.getLogger("engine.api")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with a drain on the first SIGTERM/SIGINT: readiness and new requests answer 503,
    open requests may finish within timeout_s, the rest end with finish_reason "abort" (and [DONE] when
    streamed); then uvicorn's own graceful exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, timeout_s: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.timeout_s = timeout_s
        self.drain_requested = False
        self.drain_task: asyncio.Task[None] | None = None
        self.tick: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # set by main_loop

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_requested:
            super().handle_exit(sig, frame)
        self.drain_requested = True  # acted on by on_tick, inside the event loop
        self.tick_now()

    def tick_now(self) -> None:
        """End main_loop's wait for its next tick (safe in a signal handler: call_soon_threadsafe)."""
        if self.tick is not None:
            self.tick[0].call_soon_threadsafe(self.tick[1].set)

    async def main_loop(self) -> None:
        """uvicorn's loop of ticks every 0.1 s, where a signal or the drain's end ticks at once: a stop
        takes no tick's wait."""
        self.tick = (asyncio.get_running_loop(), asyncio.Event())
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.tick[1].wait(), 0.1)
            self.tick[1].clear()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_task is None:
            self.drain_task = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        self.serving.draining = True
        client = self.serving.client
        logger.info("draining: %d requests open, up to %.0f s", client.num_open_requests, self.timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while client.num_open_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        aborted = await client.abort_all(SHUTDOWN_REASON)
        if aborted:
            logger.warning("drain timeout: aborted %d open requests", aborted)
        self.should_exit = True
        self.tick_now()


# what the thread that loads the tokenizer while the engine's worker loads adds to its nice value (serve)
TOKENIZER_NICE = 10


def in_yielding_thread(function: Any, *args: Any) -> asyncio.Future[Any]:
    """function(*args) on a thread of its own that yields the processors to the others (nice
    TOKENIZER_NICE): at start the tokenizer's load (transformers' import, 0.6 CPU-second) runs while the
    engine's worker loads on the same cores, and it is the worker that /health waits for."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        with contextlib.suppress(OSError):  # (a thread is a task to the kernel: only this one yields)
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + TOKENIZER_NICE)
            )
        try:
            done.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 (the awaiting task gets it)
            done.set_exception(error)

    threading.Thread(target=run, name="tokenizer-load", daemon=True).start()
    return asyncio.wrap_future(done)


async def serve(config: ServerConfig, sock: socket.socket | None, phases: StartupPhases) -> None:
    # The tokenizer (transformers' import, seconds) loads while the engine loads the model, on a thread
    # that yields the cores to the worker's load; attached without a model name, it waits for the
    # engine's.
    tokenizer_path = config.tokenizer or config.model
    tokenizer_load = (
        in_yielding_thread(load_tokenizer, tokenizer_path, config.cache_dir)
        if tokenizer_path and not config.tokens_only
        else None
    )
    try:
        client = await connect_engines(
            config.input_address,
            config.output_address,
            f"api{config.server_index}-{os.getpid()}",
            config.register_timeout_s,
            heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
        )
    except TimeoutError as error:
        raise SystemExit(
            f"API server {config.server_index}: no engine answered at {config.input_address} "
            f"within {config.register_timeout_s:.0f} s ({error}). Is the address right, and is the engine up?"
        ) from None
    assert client.model_info is not None
    model_info = client.model_info
    phases.mark("engine")
    if tokenizer_load is None and not config.tokens_only:
        tokenizer_load = asyncio.create_task(
            asyncio.to_thread(load_tokenizer, model_info.model, config.cache_dir)
        )
    tokenizer = await tokenizer_load if tokenizer_load is not None else None  # --tokens-only: none
    phases.mark("tokenizer")
    if config.grpc:
        from frontend.grpc_door.server import run_grpc

        await run_grpc(config, phases, client, tokenizer, model_info)
        return
    assert sock is not None
    await run_app(config, sock, phases, client, tokenizer, model_info)


async def run_app(
    config: ServerConfig,
    sock: socket.socket,
    phases: StartupPhases,
    client: Any,
    tokenizer: Any,
    model_info: Any,
) -> None:
    """The app over its engine client (or, for `engine launch render`, over none), served on sock."""
    metrics = Metrics(model_info, prefix=config.metrics_prefix)
    try:
        serving = build_serving(config, AsyncLLM(client, tokenizer, metrics), model_info)
    except ImportError as error:  # a model's processor needs a package this install lacks (torchvision)
        raise SystemExit(f"API server {config.server_index}: {model_info.model}: {error}".strip()) from None
    app = build_app(AppDeps(config, serving, metrics))
    uv_config = uvicorn.Config(
        app,
        log_level=config.uvicorn_log_level or config.log_level,
        # None: uvicorn's loggers (its access lines too) go through our handler, in --log-format
        log_config=None,
        loop="uvloop",
        access_log=config.uvicorn_access_log,
        # NOTE: after the drain, what is left is aborted streams writing their last chunk and idle keep-alive
        # connections; an idle TLS connection stays open until its client answers the close_notify, which
        # clients seldom do, so a longer grace only held up the exit (10 s a TLS client, at every SIGTERM)
        timeout_graceful_shutdown=3,
        **tls_options(config),
    )
    uv_config.load()  # builds the SSL context now, so that the refresher holds the one uvicorn serves
    refresher = None
    if config.enable_ssl_refresh and uv_config.ssl is not None and config.ssl_keyfile and config.ssl_certfile:
        refresher = CertRefresher(uv_config.ssl, config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs)
        refresher.start()
    server = DrainingServer(uv_config, serving, config.shutdown_timeout_s)
    # The launcher's word that the engine process is gone: fail open requests now, not after the
    # heartbeat timeout.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, client.mark_dead, "the engine process exited"
    )
    # Startup's objects (FastAPI, transformers' modules, the tokenizer: ~350K) live as long as we do; a
    # full collection walked them in 230-290 ms, a stall of every stream. Frozen, it walks only new ones.
    gc.collect()
    gc.freeze()
    phases.mark("app")
    phases.log(logger)
    logger.info("API server %d ready", config.server_index)
    # (uvicorn accepts on sock from its first turn; what comes meanwhile waits in its backlog)
    say_ready(config)
    try:
        await server.serve(sockets=[sock])
    finally:
        if refresher is not None:
            refresher.stop()
        serving.responses.close()  # its writes called so far land first
        client.close()


def tls_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's ssl_* options: HTTPS when both a key and a certificate are given."""
    if not (config.ssl_keyfile and config.ssl_certfile):
        return {}
    options: dict[str, Any] = {
        "ssl_keyfile": config.ssl_keyfile,
        "ssl_certfile": config.ssl_certfile,
        "ssl_cert_reqs": config.ssl_cert_reqs,
    }
    if config.ssl_ca_certs:
        options["ssl_ca_certs"] = config.ssl_ca_certs
    return options


def main() -> None:
    phases = StartupPhases("API server")
    # What torch the API server runs (transformers' Whisper features, image processors) takes one thread:
    # the cores are the worker's, and an OpenMP team here spun against it (read before torch's import)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM when the launcher dies, even killed outright: drain, then go
    exit_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else 0, signal.SIGTERM)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=ServerConfig)
    configure_logging(config.log_level, config.log_format)
    phases.process = f"API server {config.server_index}"
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd) if fd >= 0 else None  # -1: a gRPC server, which binds its own port
    import uvloop

    gc.freeze()  # the modules' objects are never garbage: the collection once the app is built skips them
    phases.mark("imports")
    uvloop.run(serve(config, sock, phases))


if __name__ == "__main__":
    main()
