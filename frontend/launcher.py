"""`engine serve`: binds the HTTP port (frontend/server/listen.py), starts the EngineCore (unless attaching)
and N API servers that share the port, and supervises them until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from frontend.api_servers import ApiServerPool
from frontend.config.engine_args import EngineArgs
from frontend.config.flags import ConfigError, naming
from frontend.config.server_args import ServerArgs
from frontend.engine.process import EngineGroup, WorkerNode
from frontend.server.config import ServerConfig
from frontend.server.listen import bind_http_sockets, bind_unix_socket
from frontend.server.tls import check_tls_files
from frontend.server.user_middleware import import_middleware
from protocol import temp_folders
from protocol.config import EngineConfig
from protocol.errors import InvalidParameterError
from protocol.log_format import configure_logging
from protocol.startup import StartupPhases

if TYPE_CHECKING:
    from frontend.engine.elastic import ElasticScaler

logger = logging.getLogger("engine.launcher")


def engine_addresses(address: str) -> tuple[str, str]:
    """tcp://HOST:PORT -> (input on PORT, output on PORT + 1); ipc://PATH -> PATH-input, PATH-output."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"--engine-address must look like tcp://HOST:PORT, got {address!r}")
        return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"
    if address.startswith("ipc://"):
        return f"{address}-input", f"{address}-output"
    raise SystemExit(f"engine addresses are tcp://HOST:PORT or ipc://PATH, got {address!r}")


def check_exposure(address: str, allow_remote: bool, flag: str = "--engine-address") -> None:
    """The engine's sockets have no authentication: binding beyond loopback takes an explicit flag."""
    if not address.startswith("tcp://") or allow_remote:
        return
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise ConfigError(
            flag,
            f"{address} would expose the engine (which has no authentication) beyond this machine; add "
            "--allow-remote-engine if that is intended (and firewall it)",
        )


class Supervisor:
    # After the engine died: how long the API servers keep answering 503 (and failing open requests
    # with a clear error) before the launcher stops them and exits non-zero for a restart.
    DEAD_ENGINE_GRACE_S = 5.0

    def __init__(self, shutdown_timeout_s: float = 30.0) -> None:
        self.engine: EngineGroup | WorkerNode | None = None  # what runs the model here
        self.api_servers: ApiServerPool | None = None  # none headless
        self.stopping = False
        self.metrics_dir: str | None = None  # ours to remove at exit
        self.state_dir: str | None = None  # ours to remove at exit: the responses store
        self.shutdown_timeout_s = shutdown_timeout_s
        self.control: ScaleControl | None = None  # elastic data parallel: the API servers' scale requests

    def run(self) -> int:
        # A signal also writes a byte to this socket, so a SIGTERM ends the wait between two looks at the
        # processes at once instead of after its 0.2 s (tests and supervisors stop servers often).
        wake, wake_writer = socket.socketpair()
        wake.setblocking(False)
        wake_writer.setblocking(False)
        previous = signal.set_wakeup_fd(wake_writer.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        try:
            return self._supervise(wake)
        finally:
            signal.set_wakeup_fd(previous)
            wake.close()
            wake_writer.close()

    def _wait(self, wake: socket.socket, timeout_s: float) -> None:
        """timeout_s, or until a signal or (elastic data parallel) a scale request comes."""
        if self.control is not None:
            self.control.serve(timeout_s, wake)  # a scale runs here, between two looks at the processes
        else:
            select.select([wake], [], [], timeout_s)
        with contextlib.suppress(BlockingIOError):
            while wake.recv(64):
                pass

    def _supervise(self, wake: socket.socket) -> int:
        engine_died_at: float | None = None
        while not self.stopping:
            self._wait(wake, 0.2)
            if isinstance(self.engine, WorkerNode) and not self.engine.is_alive():
                code = self.engine.returncode  # 0: rank 0 passed the engine's shutdown on
                logger.log(
                    logging.INFO if code == 0 else logging.ERROR, "a rank exited (code %s); stopping", code
                )
                self.shutdown()
                return 0 if code == 0 else 1
            if isinstance(self.engine, EngineGroup) and (reason := self.engine.refusal()) is not None:
                # the model or a setting it does not take: one line, argparse's form, exit status 2
                self.shutdown()
                print(f"engine serve: error: {reason}", file=sys.stderr, flush=True)
                return 2
            if self.engine is not None and not self.engine.is_alive() and engine_died_at is None:
                engine_died_at = time.monotonic()
                logger.error(
                    "the engine process exited (code %s); stopping with an error",
                    self.engine.returncode,
                )
                if self.api_servers is not None:
                    self.api_servers.signal_all(signal.SIGUSR1)  # fail open requests now, /health 503
            # headless: no API server to keep answering 503 meanwhile
            grace = self.DEAD_ENGINE_GRACE_S if self.api_servers is not None else 0.0
            if engine_died_at is not None and time.monotonic() - engine_died_at > grace:
                self.shutdown()
                return 1
            if self.api_servers is not None and engine_died_at is None and not self.stopping:
                self.api_servers.look()  # one that died is started again
            if self.api_servers is not None and self.api_servers.all_exited():
                logger.error("every API server exited; stopping")
                self.shutdown()
                return 1
        return self.shutdown()

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def shutdown(self) -> int:
        """API servers first (each drains within the shutdown timeout), then the engine."""
        if self.api_servers is not None:
            self.api_servers.stop(self.shutdown_timeout_s + 15)
        if self.engine is not None:
            self.engine.shutdown()
        if self.control is not None:
            self.control.close()
        for folder in (self.metrics_dir, self.state_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return 0


class ScaleControl:
    """The launcher's control socket (ZeroMQ ROUTER on ipc, in its state folder): an API server's
    POST /scale_elastic_ep arrives as JSON {"new_data_parallel_size", "drain_timeout"}, the answer is JSON
    {"data_parallel_size"} or {"error", "param"}."""

    def __init__(self, scaler: ElasticScaler, folder: str) -> None:
        import zmq

        self.scaler = scaler
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{folder}/control"
        self.socket.bind(self.address)

    def serve(self, timeout_s: float, wake: socket.socket) -> None:
        """One scale request, if one comes within timeout_s (or before `wake` is readable)."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        if self.socket not in dict(poller.poll(int(timeout_s * 1000))):
            return
        identity, _, body = self.socket.recv_multipart()
        try:
            ask = json.loads(body)
            answer = self.scaler.scale(
                int(ask["new_data_parallel_size"]), float(ask.get("drain_timeout", 120))
            )
        except InvalidParameterError as error:
            answer = {"error": error.message, "param": error.param}
        except (ValueError, KeyError, TypeError) as error:
            answer = {"error": f"a scale request is {{new_data_parallel_size, drain_timeout}}: {error}"}
        except Exception as error:  # noqa: BLE001 (the scale failed; the old set serves on)
            logger.error("scaling failed: %s", error)
            answer = {"error": f"scaling failed, the engines are as they were: {error}", "failed": True}
        self.socket.send_multipart([identity, b"", json.dumps(answer).encode()])

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def check_parsers(args: ServerArgs) -> None:
    """A bad parser name or plugin (ConfigError naming its flag), middleware or TLS file (SystemExit)
    stops us before the engine loads."""
    from frontend.parsers.registry import Parsers

    with naming("--tool-parser-plugin"):
        parsers = Parsers.with_plugin(args.tool_parser_plugin)
    if args.tool_call_parser:
        with naming("--tool-call-parser"):
            parsers.tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        with naming("--reasoning-parser"):
            parsers.reasoning_parser(args.reasoning_parser)
    for path in args.middleware:
        import_middleware(path)
    check_tls_files(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def server_config(
    engine_args: EngineArgs,
    args: ServerArgs,
    model: str,
    input_address: str,
    output_address: str,
    server_index: int = 0,
) -> ServerConfig:
    """What an API server (or `engine run-batch`, which runs the same app in-process) is told; reads the
    --chat-template and --api-key-file files (ConfigError when it cannot)."""
    chat_template = None
    if args.chat_template:
        chat_template = args.chat_template
        if os.path.exists(args.chat_template):
            chat_template = _read("--chat-template", args.chat_template)
    try:
        api_keys = args.api_keys()
    except OSError as error:
        raise ConfigError("--api-key-file", f"cannot read {args.api_key_file}: {error.strerror}") from None
    return ServerConfig(
        model=model,
        input_address=input_address,
        output_address=output_address,
        server_index=server_index,
        api_keys=api_keys,
        chat_template=chat_template,
        allowed_origins=args.allowed_origins,
        cache_dir=engine_args.cache_dir,
        log_level=engine_args.log_level,
        generation_config=args.generation_config,
        log_format=engine_args.log_format,
        log_requests=args.enable_log_requests,
        max_request_body_bytes=int(args.max_request_body_mb * (1 << 20)),
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_inflight_requests=args.max_inflight_requests,
        shutdown_timeout_s=args.shutdown_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout_s,
        enable_docs=args.enable_fastapi_docs,
        register_timeout_s=args.engine_connect_timeout_s,
        metrics_prefix=args.metrics_prefix,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        tool_parser_plugin=args.tool_parser_plugin,
        reasoning_parser=args.reasoning_parser,
        responses_store_max_count=args.responses_store_max_count,
        responses_store_max_bytes=int(args.responses_store_max_mb * (1 << 20)),
        tool_servers=args.tool_servers,
        mcp_allowed_urls=args.mcp_allowed_urls,
        mcp_timeout_s=args.mcp_timeout_s,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        enable_ssl_refresh=args.enable_ssl_refresh,
        root_path=args.root_path or "",
        uvicorn_log_level=args.uvicorn_log_level,
        uvicorn_access_log=args.enable_uvicorn_access_log,
        middleware=args.middleware,
        max_log_len=args.max_log_len,
        force_include_usage=args.enable_force_include_usage,
        response_role=args.response_role,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        tokens_only=args.tokens_only,
        grpc=args.grpc,
        grpc_host=args.host,
        grpc_port=args.port,
        grpc_shared_port=args.api_server_count > 1,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        fingerprint_mode=args.fingerprint_mode,
        fingerprint_value=args.fingerprint_value,
    )


def serve(engine_args: EngineArgs, args: ServerArgs) -> int:
    """Check, then start. Every check runs before the first process starts: a bad flag raises ConfigError,
    a missing model ModelNotFoundError, a port in use SystemExit, and nothing is left behind."""
    configure_logging(engine_args.log_level, engine_args.log_format)
    phases = StartupPhases("launcher")
    phases.mark("imports")
    if engine_args.node_rank > 0:
        return _serve_worker_node(engine_args, args)
    if not args.headless:
        check_parsers(args)
    phases.mark("parsers")
    # The HTTP port first: a port in use must stop us before an engine is started (and left behind).
    sockets: list[socket.socket] | None = None
    if args.uds:
        sockets = [bind_unix_socket(args.uds)] * args.api_server_count
    elif not args.headless:
        # gRPC servers bind the port themselves: one socket only checks it is free
        count = 1 if args.grpc else args.api_server_count
        sockets = bind_http_sockets(args.host, args.port, count)
    engine_config, model, tokenizer, addresses = resolve_engine(engine_args, args)
    # What the API servers are told, built before anything starts (an unreadable --api-key-file stops us
    # here too); the engine's addresses follow once its process has them.
    api_config = None
    if sockets is not None:
        api_config = msgspec.structs.replace(
            server_config(engine_args, args, model, *addresses), tokenizer=tokenizer
        )
    phases.mark("config")
    supervisor = Supervisor(args.shutdown_timeout_s)
    if engine_config is not None:
        head = ""  # engine 0's input address, where this machine's engines announce themselves
        if engine_args.data_parallel_start_rank > 0 and engine_args.data_parallel_address:
            head = f"tcp://{engine_args.data_parallel_address}:{engine_args.data_parallel_rpc_port}"
        group = EngineGroup(
            engine_config, engine_args.data_parallel_size, engine_args.data_parallel_local_ranks, head,
            elastic=engine_args.enable_elastic_ep,
        )  # fmt: skip
        supervisor.engine = group
        phases.mark("engine process")
        addresses = (group.config.input_address, group.config.output_address)
    if sockets is None or api_config is None:
        print(f"engine: headless; the engine listens on {addresses[0]} and {addresses[1]}", flush=True)
        return supervisor.run()
    try:
        api_config = msgspec.structs.replace(
            api_config, input_address=addresses[0], output_address=addresses[1]
        )
        return _start_api_servers(supervisor, sockets, args, api_config, phases)
    except BaseException:
        supervisor.shutdown()
        raise


def _serve_worker_node(engine_args: EngineArgs, args: ServerArgs) -> int:
    """--node-rank above 0: this machine's tensor-parallel ranks only; the engine runs on node 0."""
    if not args.headless:
        raise ConfigError(
            "--node-rank", "above 0 runs ranks only: add --headless (the API servers run on node 0)"
        )
    config = engine_args.engine_config()
    supervisor = Supervisor(args.shutdown_timeout_s)
    supervisor.engine = WorkerNode(config)
    parallel = config.worker.parallel
    ranks = parallel.local_ranks
    print(
        f"engine: worker node {parallel.node_rank} of {parallel.nnodes}, ranks {ranks.start}-{ranks.stop - 1} "
        f"of {parallel.tensor_parallel_size}, joining {parallel.master_addr}:{parallel.master_port}",
        flush=True,
    )
    return supervisor.run()


def resolve_engine(
    engine_args: EngineArgs, args: ServerArgs
) -> tuple[EngineConfig | None, str, str | None, tuple[str, str]]:
    """The engine's config (None with --attach: it runs elsewhere), the model and tokenizer folders, resolved
    once here for the engine and the API servers alike, and the engine's addresses ("" until the engine
    process picks them)."""
    from frontend.model_files import resolve_model

    if args.attach:
        # "": the tokenizer of the engine's model
        model = (
            resolve_model(engine_args.model, engine_args.revision, engine_args.download_dir)
            if engine_args.model
            else ""
        )
        return None, model, engine_args.resolved_tokenizer(), engine_addresses(args.attach)
    if args.headless and not (args.engine_address or engine_args.data_parallel_address):
        raise ConfigError("--headless", "needs --engine-address tcp://HOST:PORT (or --data-parallel-address)")
    config = engine_args.engine_config()
    address = args.engine_address
    dp_host, dp_port = engine_args.data_parallel_address, engine_args.data_parallel_rpc_port
    if not address and dp_host:
        # a machine past the first listens on its own address (towards the head) and announces it there
        host = dp_host if engine_args.data_parallel_start_rank == 0 else local_address_towards(dp_host)
        address = f"tcp://{host}:{dp_port}"
    if address:
        flag = "--engine-address" if args.engine_address else "--data-parallel-address"
        check_exposure(address, args.allow_remote_engine, flag)
        config.input_address, config.output_address = engine_addresses(address)
    return config, config.worker.model, config.worker.tokenizer, (config.input_address, config.output_address)


def local_address_towards(host: str) -> str:
    """This machine's address on the interface that reaches host (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _start_api_servers(
    supervisor: Supervisor,
    sockets: list[socket.socket],
    args: ServerArgs,
    api_config: ServerConfig,
    phases: StartupPhases,
) -> int:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Every API server writes its metrics here; /metrics on any of them sums the files.
        supervisor.metrics_dir = temp_folders.folder("metrics")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = supervisor.metrics_dir
    supervisor.state_dir = temp_folders.folder("state")
    supervisor.api_servers = ApiServerPool(supervisor.state_dir)
    store = os.path.join(supervisor.state_dir, "responses.sqlite")
    if isinstance(supervisor.engine, EngineGroup) and supervisor.engine.elastic:
        from frontend.engine.elastic import ElasticScaler

        scaler = ElasticScaler(supervisor.engine, api_config.register_timeout_s)
        supervisor.control = ScaleControl(scaler, supervisor.state_dir)
        api_config = msgspec.structs.replace(api_config, control_address=supervisor.control.address)
    # read once, here: every API server gets the launcher's answer
    dev_mode, runtime_lora = ServerArgs.dev_mode(), ServerArgs.runtime_lora_updating()
    if args.grpc:
        # gRPC binds its own port: the launcher's socket only checked it was free, and must not take
        # the connections the gRPC servers' SO_REUSEPORT group would share with it
        sockets[0].close()
    for index in range(args.api_server_count):
        config = msgspec.structs.replace(
            api_config,
            server_index=index,
            responses_store_path=store,
            dev_mode=dev_mode,
            runtime_lora_updating=runtime_lora,
        )
        supervisor.api_servers.start(None if args.grpc else sockets[index], config)
    phases.mark("API server processes")
    phases.log(logger)
    url = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}{args.root_path or ''}"
    if args.grpc:
        url = f"grpc://{args.host}:{args.port}"
    if args.uds:
        url = f"unix:{args.uds}"
    print(
        f"engine: serving {api_config.model} on {url} with {args.api_server_count} API server(s); "
        f"engine at {api_config.input_address}",
        flush=True,
    )
    try:
        return supervisor.run()
    finally:
        if args.uds and os.path.exists(args.uds):
            os.unlink(args.uds)


def _read(flag: str, path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError(flag, f"cannot read {path}: {reason}") from None
