"""Prometheus metrics of an API server, prefix `engine:` (or `vllm:`, so dashboards built for vLLM work).

Per-request counters and histograms are kept by the API server that owns the request, in
prometheus-client's multiprocess mode (the launcher sets PROMETHEUS_MULTIPROC_DIR), so /metrics on any
API server sums over all of them and nothing is counted twice. Engine-wide values (running, waiting,
KV usage, prefix-cache queries/hits, preemptions, tokens per step) come from the engine's own
SchedulerStats, which every API server receives at least once a second, and are exported once by a
collector. A family that vLLM also exports has vLLM's name (after the prefix) and meaning.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from protocol.messages import ITERATION_TOKENS_BUCKETS, ModelInfo, RequestOutput

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
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
UNMETERED_PATHS = frozenset({"/metrics", "/health", "/ping", "/load", "/version"})


WEBSOCKET_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)  # vLLM's


class Metrics:
    """The per-request families, named `{prefix}:...`. `registry` is for tests: render() reads REGISTRY."""

    def __init__(
        self, model_info: ModelInfo, prefix: str = "engine", *, registry: CollectorRegistry | None = REGISTRY
    ) -> None:
        self.model_name = model_info.served_model_names[0]
        # vLLM's labels: the engine is the data-parallel rank that served the request ("0" with one)
        labels = ("model_name", "engine")

        def counter(name: str, doc: str, labelnames: Sequence[str]) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labelnames, registry=registry)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labelnames: Sequence[str] = labels
        ) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labelnames, buckets=buckets, registry=registry)

        def info(name: str, doc: str, labelnames: Sequence[str]) -> Gauge:
            return Gauge(
                f"{prefix}:{name}", doc, labelnames, multiprocess_mode="mostrecent", registry=registry
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.", labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.", labels)
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", [*labels, "finished_reason"]
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", LATENCY_BUCKETS)
        # NOTE: vLLM's older name for inter_token_latency_seconds, with the same observations (one per
        # token after the first); vLLM's own Grafana dashboard plots it as "Time Per Output Token".
        self.tpot = histogram(
            "time_per_output_token_seconds", "Time between tokens (vLLM's older name).", LATENCY_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time / (generated tokens - 1); 0 for a request of one token.",
            LATENCY_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting in the engine.", LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Prefill time.", LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Decode time.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.request_params_n = histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter, when set.", TOKEN_BUCKETS
        )
        # a vision-language model's processed images, looked up by content hash or uuid (vLLM's names)
        self.mm_cache_queries = counter(
            "mm_cache_queries", "Images looked up in the processor cache.", ["model_name"]
        )
        self.mm_cache_hits = counter("mm_cache_hits", "Images found in the processor cache.", ["model_name"])
        # the realtime WebSocket's connections (frontend/audio/realtime.py), as vLLM names them
        self.websocket_active = Gauge(
            f"{prefix}:websocket_connections_active", "Open realtime WebSocket connections.",
            ["model_name"], multiprocess_mode="livesum", registry=registry,
        )  # fmt: skip
        self.websocket_total = counter(
            "websocket_connections_total", "Realtime WebSocket connections.", ["model_name"]
        )
        self.websocket_duration = histogram(
            "websocket_connection_duration_seconds", "How long realtime WebSocket connections stay open.",
            WEBSOCKET_BUCKETS, ["model_name"],
        )  # fmt: skip
        self.engine_info = info(
            "engine_info",
            "The model and engine this server fronts.",
            ["model_name", "model", "dtype", "block_size", "version"],
        )
        self.engine_info.labels(
            self.model_name,
            model_info.model,
            model_info.dtype,
            str(model_info.block_size),
            model_info.engine_version,
        ).set(1)
        # vLLM's labels that we can fill truthfully: the KV cache is kept in the model's dtype.
        self.cache_config_info = info(
            "cache_config_info",
            "The engine's KV cache configuration.",
            ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
        )
        self.cache_config_info.labels(
            str(model_info.block_size),
            model_info.dtype,
            str(model_info.enable_prefix_caching),
            str(model_info.num_kv_blocks),
        ).set(1)
        # which runner the engine runs (vLLM's runner: generate or pooling) and, pooling, its tasks
        self.runner_info = info(
            "model_runner_info", "The model's runner and tasks.", ["model_name", "runner", "tasks"]
        )
        self.runner_info.labels(
            self.model_name, model_info.runner, ",".join(model_info.pooling_tasks) or "generate"
        ).set(1)
        self.pooling_requests = counter(
            "pooling_requests",
            "Finished pooling requests (embeddings, scores, classification) by task.",
            [*labels, "task"],
        )
        self.http_requests = counter("http_requests", "HTTP requests.", ["method", "path", "status"])
        self.http_latency = histogram(
            "http_request_duration_seconds", "HTTP request latency.", LATENCY_BUCKETS, ("method", "path")
        )

    def observe_token(self, state: RequestTiming, now: float, num_tokens: int, engine: int = 0) -> None:
        if num_tokens == 0:
            return
        labels = (self.model_name, str(engine))
        if state.first_token_time is None:
            state.first_token_time = now
            self.ttft.labels(*labels).observe(now - state.arrival_time)
        elif state.last_token_time is not None:
            self.itl.labels(*labels).observe(now - state.last_token_time)
            self.tpot.labels(*labels).observe(now - state.last_token_time)
        state.last_token_time = now

    def observe_finished(
        self,
        state: RequestTiming,
        output: RequestOutput,
        finish_reason: str,
        num_prompt: int,
        num_generated: int,
        now: float,
        *,
        n: int | None = 1,
        max_tokens: int | None = None,
        model_name: str | None = None,
        engine: int = 0,
    ) -> None:
        """One finished request, or one choice of an n > 1 request. `n` and `max_tokens` are the
        request's parameters, given with its last choice to finish only (None for the others), so
        request_params_* count each request once, as vLLM's do. model_name: the LoRA adapter the request
        named, which the request and token counters carry as their model_name (None: the base model's);
        engine: the data-parallel rank that served it."""
        name, rank = (self.model_name, str(engine)), str(engine)
        asked = model_name or self.model_name
        self.prompt_tokens.labels(asked, rank).inc(num_prompt)
        self.generation_tokens.labels(asked, rank).inc(num_generated)
        self.request_success.labels(asked, rank, finish_reason).inc()
        self.e2e.labels(*name).observe(now - state.arrival_time)
        self.queue.labels(*name).observe(output.queue_time_s)
        self.prefill.labels(*name).observe(output.prefill_time_s)
        self.decode.labels(*name).observe(output.decode_time_s)
        self.request_prompt_tokens.labels(*name).observe(num_prompt)
        self.request_generation_tokens.labels(*name).observe(num_generated)
        # vLLM's: the first token's time is prefill, so the decode time is spread over the others.
        tpot = output.decode_time_s / (num_generated - 1) if num_generated > 1 else 0.0
        self.request_tpot.labels(*name).observe(tpot)
        if n is None:
            return
        self.request_params_n.labels(*name).observe(n)
        if max_tokens:  # vLLM skips an unset (or zero) max_tokens
            self.request_params_max_tokens.labels(*name).observe(max_tokens)

    def observe_pooling(
        self,
        started: float,
        output: RequestOutput,
        num_prompt: int,
        task: str,
        model_name: str | None = None,
        engine: int = 0,
    ) -> None:
        """A finished pooling request: the request and token counters and the latency histograms count it
        as a request whose one output is its pooled value (its time to that value is its TTFT)."""
        name, rank, now = (self.model_name, str(engine)), str(engine), time.monotonic()
        asked = model_name or self.model_name
        self.prompt_tokens.labels(asked, rank).inc(num_prompt)
        self.request_success.labels(asked, rank, output.finish_reason or "stop").inc()
        self.pooling_requests.labels(asked, rank, task).inc()
        self.ttft.labels(*name).observe(now - started)
        self.e2e.labels(*name).observe(now - started)
        self.queue.labels(*name).observe(output.queue_time_s)
        self.prefill.labels(*name).observe(output.prefill_time_s)
        self.request_prompt_tokens.labels(*name).observe(num_prompt)


class RequestTiming:
    __slots__ = ("arrival_time", "first_token_time", "last_token_time")

    def __init__(self, arrival_time: float) -> None:
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None


class EngineStatsCollector:
    """Exports each engine's latest SchedulerStats, as received by this API server, labelled with the
    engine's data-parallel rank (`engine="0"`, as vLLM labels them)."""

    def __init__(self, get_stats: Any, model_name: str, prefix: str = "engine") -> None:
        self._get_stats = get_stats  # () -> [SchedulerStats | None], one per engine in rank order
        self._model_name = model_name
        self._prefix = prefix

    def collect(self) -> Any:
        engines = [(str(rank), stats) for rank, stats in enumerate(self._get_stats()) if stats is not None]
        if not engines:
            return
        prefix, labels = self._prefix, ["model_name", "engine"]
        for name, doc, field in (
            ("num_requests_running", "Requests in the running batch.", "num_running"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", "kv_cache_usage"),
        ):
            gauge = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            for engine, stats in engines:
                gauge.add_metric([self._model_name, engine], getattr(stats, field))
            yield gauge
        for name, doc, field in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            ("num_preemptions", "Requests preempted by the scheduler.", "num_preemptions"),
            (
                "engine_prompt_tokens_computed",
                "Prompt tokens the engine computed for any frontend (cache hits excluded, recomputation included).",
                "num_prompt_tokens",
            ),
            (
                "engine_generation_tokens",
                "Tokens the engine generated for any frontend, ZMQ clients included.",
                "num_generation_tokens",
            ),
            (
                "encoder_inputs",
                "Encoder inputs run: images (a vision tower), audio (a Whisper encoder).",
                "num_encoder_inputs",
            ),
            ("encoder_seconds", "Seconds the worker spent in those encoders.", "encoder_seconds"),
        ):
            counter = CounterMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            for engine, stats in engines:
                counter.add_metric([self._model_name, engine], getattr(stats, field))
            yield counter
        upper_bounds = [floatToGoString(bound) for bound in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        histogram = HistogramMetricFamily(
            f"{prefix}:iteration_tokens_total", "Tokens scheduled per engine step.", labels=labels
        )
        for engine, stats in engines:
            if len(stats.iteration_tokens_buckets) == len(upper_bounds):  # else an engine that does not count
                cumulative = itertools.accumulate(stats.iteration_tokens_buckets)
                buckets = list(zip(upper_bounds, cumulative, strict=True))
                histogram.add_metric(
                    [self._model_name, engine], buckets, sum_value=stats.iteration_tokens_sum
                )
        if histogram.samples:
            yield histogram
        lora = GaugeMetricFamily(
            f"{prefix}:lora_requests_info",
            "LoRA adapters of the running and waiting requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"],
        )
        for engine, stats in engines:
            if stats.max_loras:  # vLLM's: the adapters running and waiting, as labels; the value is the time
                waiting, running = ",".join(stats.waiting_loras), ",".join(stats.running_loras)
                lora.add_metric([str(stats.max_loras), waiting, running, engine], time.time())
        if lora.samples:
            yield lora


def render(collector: EngineStatsCollector) -> bytes:
    """The whole server's metrics: every API server's files (multiprocess mode) plus engine stats."""
    engine = CollectorRegistry()
    engine.register(collector)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        processes = CollectorRegistry()
        multiprocess.MultiProcessCollector(processes)
        return generate_latest(processes) + generate_latest(engine)
    return generate_latest(REGISTRY) + generate_latest(engine)  # a lone API server (tests)
