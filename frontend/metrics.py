"""Prometheus metrics of an API server, prefix `engine:`.

Per-request counters and histograms are kept by the API server that owns the request, in
prometheus-client's multiprocess mode (the launcher sets PROMETHEUS_MULTIPROC_DIR), so /metrics on any
API server sums over all of them and nothing is counted twice. Engine-wide values (running, waiting,
KV usage, prefix-cache queries/hits, preemptions) come from the engine's own SchedulerStats, which
every API server receives at least once a second, and are exported once by a collector.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.messages import ModelInfo, RequestOutput, SchedulerStats

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
UNMETERED_PATHS = frozenset({"/metrics", "/health", "/ping", "/load", "/version"})


class Metrics:
    def __init__(self, model_info: ModelInfo) -> None:
        self.model_name = model_info.served_model_names[0]
        labels = ["model_name"]
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens of finished requests.", labels)
        self.generation_tokens = Counter("engine:generation_tokens", "Generated tokens.", labels)
        self.request_success = Counter(
            "engine:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"]
        )
        self.ttft = Histogram(
            "engine:time_to_first_token_seconds", "Time to first token.", labels, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "engine:inter_token_latency_seconds", "Time between tokens.", labels, buckets=LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "engine:e2e_request_latency_seconds", "Request latency.", labels, buckets=LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "engine:request_queue_time_seconds",
            "Time waiting in the engine.",
            labels,
            buckets=LATENCY_BUCKETS,
        )
        self.prefill = Histogram(
            "engine:request_prefill_time_seconds", "Prefill time.", labels, buckets=LATENCY_BUCKETS
        )
        self.decode = Histogram(
            "engine:request_decode_time_seconds", "Decode time.", labels, buckets=LATENCY_BUCKETS
        )
        self.request_prompt_tokens = Histogram(
            "engine:request_prompt_tokens", "Prompt tokens per request.", labels, buckets=TOKEN_BUCKETS
        )
        self.request_generation_tokens = Histogram(
            "engine:request_generation_tokens", "Generated tokens per request.", labels, buckets=TOKEN_BUCKETS
        )
        self.engine_info = Gauge(
            "engine:engine_info",
            "The model and engine this server fronts.",
            ["model_name", "model", "dtype", "block_size", "version"],
            multiprocess_mode="mostrecent",
        )
        self.engine_info.labels(
            self.model_name,
            model_info.model,
            model_info.dtype,
            str(model_info.block_size),
            model_info.engine_version,
        ).set(1)
        self.http_requests = Counter("engine:http_requests", "HTTP requests.", ["method", "path", "status"])
        self.http_latency = Histogram(
            "engine:http_request_duration_seconds",
            "HTTP request latency.",
            ["method", "path"],
            buckets=LATENCY_BUCKETS,
        )

    def observe_token(self, state: RequestTiming, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if state.first_token_time is None:
            state.first_token_time = now
            self.ttft.labels(self.model_name).observe(now - state.arrival_time)
        elif state.last_token_time is not None:
            self.itl.labels(self.model_name).observe(now - state.last_token_time)
        state.last_token_time = now

    def observe_finished(
        self,
        state: RequestTiming,
        output: RequestOutput,
        finish_reason: str,
        num_prompt: int,
        num_generated: int,
        now: float,
    ) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(num_prompt)
        self.generation_tokens.labels(name).inc(num_generated)
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(now - state.arrival_time)
        self.queue.labels(name).observe(output.queue_time_s)
        self.prefill.labels(name).observe(output.prefill_time_s)
        self.decode.labels(name).observe(output.decode_time_s)
        self.request_prompt_tokens.labels(name).observe(num_prompt)
        self.request_generation_tokens.labels(name).observe(num_generated)


class RequestTiming:
    __slots__ = ("arrival_time", "first_token_time", "last_token_time")

    def __init__(self, arrival_time: float) -> None:
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None


class EngineStatsCollector:
    """Exports the engine's latest SchedulerStats, as received by this API server."""

    def __init__(self, get_stats: Any, model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Any:
        stats: SchedulerStats | None = self._get_stats()
        if stats is None:
            return
        label = [self._model_name]
        for name, doc, value in (
            ("engine:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("engine:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("engine:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        for name, doc, value in (
            (
                "engine:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            ("engine:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("engine:num_preemptions", "Requests preempted by the scheduler.", stats.num_preemptions),
            (
                "engine:engine_prompt_tokens_computed",
                "Prompt tokens the engine computed for any frontend (cache hits excluded, recomputation included).",
                stats.num_prompt_tokens,
            ),
            (
                "engine:engine_generation_tokens",
                "Tokens the engine generated for any frontend, ZMQ clients included.",
                stats.num_generation_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter


def render(collector: EngineStatsCollector) -> bytes:
    """The whole server's metrics: every API server's files (multiprocess mode) plus engine stats."""
    engine = CollectorRegistry()
    engine.register(collector)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        processes = CollectorRegistry()
        multiprocess.MultiProcessCollector(processes)
        return generate_latest(processes) + generate_latest(engine)
    return generate_latest(REGISTRY) + generate_latest(engine)  # a lone API server (tests)
