"""ORCA load reports (vLLM's): a request to a generation door that carries
`endpoint-load-metrics-format: text` (or `json`) gets an `endpoint-load-metrics` response header with
the engine's load, for load balancers that route on it (Envoy, gRPC's ORCA):

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=0.0
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 0.0}}

The names and the fraction (0..1) are vLLM's; the values are the engine's last stats. Any other format
(e.g. ORCA's binary one) gets no header, as in vLLM. Pure ASGI, so it never buffers a stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from typing import Any

from frontend.server.middleware import route_path
from protocol.messages import SchedulerStats

FORMAT_HEADER = b"endpoint-load-metrics-format"
REPORT_HEADER = b"endpoint-load-metrics"
# the doors vLLM reports on (with our SageMaker route), after any --root-path
REPORTED_PATHS = {"/v1/chat/completions", "/v1/completions", "/invocations"}


def named_metrics(stats: SchedulerStats | None) -> list[tuple[str, float]]:
    if stats is None:  # no step yet: an idle engine
        stats = SchedulerStats()
    return [
        ("kv_cache_usage_perc", float(stats.kv_cache_usage)),
        ("num_requests_waiting", float(stats.num_waiting)),
    ]


def orca_header(metrics_format: str, metrics: list[tuple[str, float]]) -> str | None:
    """The `endpoint-load-metrics` value in `metrics_format` (text or json, any case); None otherwise."""
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in metrics)
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": dict(metrics)})
    return None


class OrcaMiddleware:
    def __init__(self, app: Any, stats: Callable[[], SchedulerStats | None]) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) not in REPORTED_PATHS:
            await self.app(scope, receive, send)
            return
        wanted = dict(scope.get("headers") or []).get(FORMAT_HEADER)
        if not wanted:
            await self.app(scope, receive, send)
            return

        async def send_with_report(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                value = orca_header(wanted.decode("latin-1"), named_metrics(self.stats()))
                if value is not None:
                    message["headers"] = [*message.get("headers", []), (REPORT_HEADER, value.encode())]
            await send(message)

        await self.app(scope, receive, send_with_report)
