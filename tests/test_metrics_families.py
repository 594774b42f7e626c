"""The Prometheus families a vLLM dashboard reads: names, label sets and values. No model, no processes."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from engine_core.engine_core import EngineCore
from frontend.metrics import EngineStatsCollector, Metrics, RequestTiming, render
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import ITERATION_TOKENS_BUCKETS, AddRequest, ModelInfo, RequestOutput, SchedulerStats
from protocol.sampling import SamplingParams
from tests.fake_executor import FakeExecutor

INFO = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0", enable_prefix_caching=False)
M = {"model_name": "m", "engine": "0"}  # one engine: every per-request series is engine="0"


def finish(
    metrics: Metrics, decode_time_s: float, num_generated: int, n: int = 1, max_tokens: int | None = None
) -> None:
    output = RequestOutput("r", [1], decode_time_s=decode_time_s)
    metrics.observe_finished(
        RequestTiming(0.0), output, "stop", 3, num_generated, 2.0, n=n, max_tokens=max_tokens
    )


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**M, **labels})


# ---- per-request families (the API server's) ----


def test_time_per_output_token_is_vllm_s_per_token_interval() -> None:
    """vLLM's time_per_output_token_seconds is its older name for the inter-token latency."""
    registry = CollectorRegistry()
    metrics = Metrics(INFO, "vllm", registry=registry)
    timing = RequestTiming(0.0)
    for now in (1.0, 1.25, 1.75):  # the first token is TTFT; then intervals of 0.25 and 0.5
        metrics.observe_token(timing, now, 1)
    for family in ("time_per_output_token_seconds", "inter_token_latency_seconds"):
        assert value(registry, f"vllm:{family}_count") == 2
        assert value(registry, f"vllm:{family}_sum") == pytest.approx(0.75)
        assert value(registry, f"vllm:{family}_bucket", le="0.25") == 1


def test_request_time_per_output_token_spreads_decode_over_the_tokens_after_the_first() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(INFO, "vllm", registry=registry)
    finish(metrics, decode_time_s=0.5, num_generated=3)  # 0.5 s over 2 tokens
    assert value(registry, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(registry, "vllm:request_time_per_output_token_seconds_bucket", le="0.1") == 0
    assert value(registry, "vllm:request_time_per_output_token_seconds_bucket", le="0.25") == 1
    finish(metrics, decode_time_s=0.0, num_generated=1)  # vLLM observes 0 for a one-token request
    assert value(registry, "vllm:request_time_per_output_token_seconds_count") == 2
    assert value(registry, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)


def test_per_request_families_are_labelled_with_the_engine_that_served_the_request() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(INFO, "vllm", registry=registry)
    for engine, num_generated in ((0, 2), (1, 5), (1, 3)):
        timing = RequestTiming(0.0)
        metrics.observe_token(timing, 0.5, 1, engine)
        metrics.observe_token(timing, 0.75, 1, engine)
        output = RequestOutput("r", [1], queue_time_s=0.1)
        metrics.observe_finished(timing, output, "stop", 3, num_generated, 2.0, engine=engine)
    metrics.observe_pooling(0.0, RequestOutput("p", [], "stop"), 4, "embed", engine=1)
    for rank, requests, generated in (("0", 1, 2), ("1", 3, 8)):
        assert value(registry, "vllm:request_success_total", engine=rank, finished_reason="stop") == requests
        assert value(registry, "vllm:generation_tokens_total", engine=rank) == generated
        assert value(registry, "vllm:e2e_request_latency_seconds_count", engine=rank) == requests
        assert value(registry, "vllm:request_queue_time_seconds_count", engine=rank) == requests
    assert value(registry, "vllm:time_to_first_token_seconds_count", engine="1") == 3  # two + the pooling
    assert value(registry, "vllm:inter_token_latency_seconds_count", engine="0") == 1
    assert value(registry, "vllm:prompt_tokens_total", engine="1") == 3 + 3 + 4
    assert value(registry, "vllm:pooling_requests_total", engine="1", task="embed") == 1
    names = {s.name for s in registry.collect() for s in s.samples if s.labels.get("engine") == "2"}
    assert not names


def test_request_params_n_and_max_tokens() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(INFO, "vllm", registry=registry)
    metrics.observe_finished(RequestTiming(0.0), RequestOutput("r", [1]), "stop", 3, 2, 2.0)  # defaults
    finish(metrics, 0.1, 2, n=4, max_tokens=16)
    assert value(registry, "vllm:request_params_n_count") == 2
    assert value(registry, "vllm:request_params_n_sum") == 5
    assert value(registry, "vllm:request_params_n_bucket", le="1.0") == 1
    assert value(registry, "vllm:request_params_n_bucket", le="2.0") == 1
    assert value(registry, "vllm:request_params_n_bucket", le="5.0") == 2
    assert value(registry, "vllm:request_params_max_tokens_count") == 1  # unset is not observed
    assert value(registry, "vllm:request_params_max_tokens_sum") == 16
    assert value(registry, "vllm:request_params_max_tokens_bucket", le="10.0") == 0
    assert value(registry, "vllm:request_params_max_tokens_bucket", le="20.0") == 1


def test_cache_config_info_has_vllm_s_labels() -> None:
    registry = CollectorRegistry()
    Metrics(INFO, "vllm", registry=registry)
    (family,) = [f for f in registry.collect() if f.name == "vllm:cache_config_info"]
    (sample,) = family.samples
    assert family.type == "gauge" and sample.value == 1
    assert sample.labels == {
        "block_size": "16",
        "cache_dtype": "float32",
        "enable_prefix_caching": "False",
        "num_gpu_blocks": "8",
    }


# ---- engine families (from SchedulerStats) ----


def engine_value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """An engine family's sample: engine 0's (the families carry vLLM's engine label)."""
    return value(registry, name, engine="0", **labels)


def test_iteration_tokens_histogram_from_scheduler_stats() -> None:
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[2], counts[-1] = 2, 1, 1  # two 1-token steps, one of 9..16, one above 16384
    stats = SchedulerStats(num_steps=4, iteration_tokens_buckets=counts, iteration_tokens_sum=20_014)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: [stats], "m", prefix="vllm"))
    family = "vllm:iteration_tokens_total"
    assert engine_value(registry, f"{family}_bucket", le="1.0") == 2
    assert engine_value(registry, f"{family}_bucket", le="8.0") == 2
    assert engine_value(registry, f"{family}_bucket", le="16.0") == 3
    assert engine_value(registry, f"{family}_bucket", le="16384.0") == 3
    assert engine_value(registry, f"{family}_bucket", le="+Inf") == 4
    assert engine_value(registry, f"{family}_count") == 4
    assert engine_value(registry, f"{family}_sum") == 20_014


def test_iteration_tokens_left_out_for_an_engine_that_does_not_count() -> None:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: [SchedulerStats(iteration_tokens_buckets=[])], "m"))
    assert engine_value(registry, "engine:iteration_tokens_total_count") is None
    assert engine_value(registry, "engine:num_requests_running") == 0


# ---- the prefix ----

VLLM_DASHBOARD = {  # what vLLM's example Grafana dashboard and the families above query
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket",
    "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
}


def observe_everything(metrics: Metrics) -> None:
    timing = RequestTiming(0.0)
    metrics.observe_token(timing, 1.0, 1)
    metrics.observe_token(timing, 1.1, 1)
    metrics.observe_finished(timing, RequestOutput("r", [1]), "stop", 3, 2, 2.0, n=1, max_tokens=8)
    metrics.http_requests.labels("POST", "/v1/completions", "200").inc()
    metrics.http_latency.labels("POST", "/v1/completions").observe(0.1)


def sample_names(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.parametrize("prefix", ["engine", "vllm"])
def test_every_family_takes_the_prefix(prefix: str) -> None:
    registry = CollectorRegistry()
    observe_everything(Metrics(INFO, prefix, registry=registry))
    registry.register(EngineStatsCollector(lambda: [SchedulerStats()], "m", prefix=prefix))
    names = {sample.name for family in registry.collect() for sample in family.samples}
    assert names and all(name.startswith(f"{prefix}:") for name in names), names
    assert {name.replace("vllm:", f"{prefix}:", 1) for name in VLLM_DASHBOARD} <= names


@pytest.fixture
def vllm_metrics(monkeypatch: pytest.MonkeyPatch) -> Iterator[Metrics]:
    """Metrics in the default REGISTRY (what render() reads), taken out again afterwards."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics(INFO, prefix="vllm")
    yield metrics
    for collector in vars(metrics).values():
        if isinstance(collector, MetricWrapperBase):
            REGISTRY.unregister(collector)


def test_render_serves_the_vllm_dashboard(vllm_metrics: Metrics) -> None:
    observe_everything(vllm_metrics)
    text = render(EngineStatsCollector(lambda: [SchedulerStats()], "m", prefix="vllm")).decode()
    assert VLLM_DASHBOARD <= sample_names(text), VLLM_DASHBOARD - sample_names(text)
    assert 'vllm:request_params_max_tokens_sum{engine="0",model_name="m"} 8.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 0.0' in text


# ---- the engine counts its steps ----


def make_core(**kwargs: Any) -> tuple[EngineCore, FakeExecutor]:
    executor = FakeExecutor(num_kv_blocks=64, block_size=4)
    return EngineCore(EngineConfig(worker=WorkerConfig(model="fake"), **kwargs), executor), executor


def add(core: EngineCore, request_id: str, num_prompt: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(1, num_prompt + 1))
    core.add_request(
        AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params, arrival_time=0.0)
    )


def run(core: EngineCore) -> None:
    for _ in range(1000):
        if not core.has_unfinished_requests():
            return
        core.step()
        core.scheduler.check_invariants()  # the buckets sum to num_steps
    raise AssertionError("the engine did not finish")


def test_engine_counts_tokens_per_step() -> None:
    core, executor = make_core(async_scheduling=False)
    add(core, "a", num_prompt=10, max_tokens=3)  # one 10-token prefill step, then two 1-token decodes
    run(core)
    stats = core.make_stats()
    assert [step.total_num_scheduled_tokens for step in executor.steps] == [10, 1, 1]
    assert stats.iteration_tokens_buckets[0] == 2 and stats.iteration_tokens_buckets[2] == 1  # <= 1, 9..16
    assert sum(stats.iteration_tokens_buckets) == stats.num_steps == 3
    assert stats.iteration_tokens_sum == 12
    stats.iteration_tokens_buckets[0] = 99  # a copy: the output thread sends it while the engine steps
    assert core.make_stats().iteration_tokens_buckets[0] == 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_step_histogram_matches_the_steps_executed(async_scheduling: bool) -> None:
    core, executor = make_core(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    add(core, "a", num_prompt=40, max_tokens=5)  # chunked prefill beside decodes
    add(core, "b", num_prompt=10, max_tokens=7)
    run(core)
    expected = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    for step in executor.steps:
        expected[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, step.total_num_scheduled_tokens)] += 1
    stats = core.make_stats()
    assert stats.iteration_tokens_buckets == expected
    assert stats.num_steps == len(executor.steps)
    assert stats.iteration_tokens_sum == sum(step.total_num_scheduled_tokens for step in executor.steps)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_engine_reports_whether_prefix_caching_is_on(enable_prefix_caching: bool) -> None:
    core, _ = make_core(enable_prefix_caching=enable_prefix_caching)
    assert core.model_info.enable_prefix_caching is enable_prefix_caching
    registry = CollectorRegistry()
    Metrics(core.model_info, registry=registry)
    labels = {"block_size": "4", "cache_dtype": "float32", "num_gpu_blocks": "64"}
    assert registry.get_sample_value(
        "engine:cache_config_info", {**labels, "enable_prefix_caching": str(enable_prefix_caching)}
    )
