"""One gRPC front-door process (`engine serve --grpc`): the API server's engine client and OpenAIServing,
served as vLLM's VllmEngine service with grpc.aio, beside the standard grpc.health.v1 service and server
reflection (grpcurl lists and calls it without the .proto).

Health follows the engine: NOT_SERVING when it dies or stalls, and from the first SIGTERM (the drain:
new calls get UNAVAILABLE, open ones may finish within --shutdown-timeout-s, the rest end with
finish_reason "abort"). With --api-key, every VllmEngine call needs `authorization: Bearer KEY`
metadata (health and reflection stay open, as /health is)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from frontend.engine.async_llm import AsyncLLM
from frontend.engine.output_processor import SHUTDOWN_REASON
from frontend.metrics import Metrics
from frontend.openai.serving import OpenAIServing
from frontend.server.config import ServerConfig, say_ready
from frontend.server.deps import build_serving
from protocol.startup import StartupPhases

from . import vllm_engine_pb2 as pb
from . import vllm_engine_pb2_grpc as pb_grpc
from .servicer import VllmEngineServicer, health_problem

logger = logging.getLogger("engine.api")

SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
HEALTH_POLL_S = 0.25


class ApiKeys(grpc.aio.ServerInterceptor):
    """--api-key for the VllmEngine service: `authorization: Bearer KEY` metadata, else UNAUTHENTICATED."""

    def __init__(self, keys: list[str]) -> None:
        self.allowed = {f"Bearer {key}" for key in keys}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.startswith(f"/{SERVICE}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") in self.allowed:
            return await continuation(details)
        return _refusal(details.method)


def _refusal(method: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: authorization: Bearer KEY"
        )

    if method.endswith("/Generate"):
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


async def run_grpc(
    config: ServerConfig, phases: StartupPhases, client: Any, tokenizer: Any, model_info: Any
) -> None:
    metrics = Metrics(model_info, prefix=config.metrics_prefix)
    serving = build_serving(config, AsyncLLM(client, tokenizer, metrics), model_info)
    interceptors = [ApiKeys(config.api_keys)] if config.api_keys else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            # N servers share the port (the kernel spreads connections); one alone claims it
            ("grpc.so_reuseport", int(config.grpc_shared_port)),
            # a router pings on idle connections while a long non-streamed Generate runs
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )
    pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(serving, time.time()), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = (
        f"[{config.grpc_host}]:{config.grpc_port}"
        if ":" in config.grpc_host
        else f"{config.grpc_host}:{config.grpc_port}"
    )
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        raise SystemExit(f"gRPC server {config.server_index}: cannot listen on {address}: {error}") from None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, client.mark_dead, "the engine process exited")
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1:  # a second signal: go now
            raise SystemExit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    watcher = asyncio.create_task(_follow_health(serving, health, config.engine_stall_timeout_s))
    gc.collect()
    gc.freeze()
    phases.mark("app")
    phases.log(logger)
    logger.info("gRPC server %d ready on %s", config.server_index, address)
    say_ready(config)
    try:
        await stop.wait()
        await _drain(serving, health, config.shutdown_timeout_s)
    finally:
        watcher.cancel()
        await server.stop(grace=3)
        serving.responses.close()
        client.close()


async def _follow_health(serving: OpenAIServing, health: HealthServicer, stall_timeout_s: float) -> None:
    serving_now: bool | None = None
    while True:
        ok = health_problem(serving, stall_timeout_s) is None
        if ok != serving_now:
            status = (
                health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE):
                await health.set(name, status)
            serving_now = ok
        await asyncio.sleep(HEALTH_POLL_S)


async def _drain(serving: OpenAIServing, health: HealthServicer, timeout_s: float) -> None:
    serving.draining = True
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    client = serving.client
    logger.info("draining: %d requests open, up to %.0f s", client.num_open_requests, timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while client.num_open_requests and loop.time() < deadline:
        await asyncio.sleep(0.05)
    aborted = await client.abort_all(SHUTDOWN_REASON)
    if aborted:
        logger.warning("drain timeout: aborted %d open requests", aborted)
