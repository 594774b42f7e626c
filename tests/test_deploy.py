"""Deploy assets parse, query only metrics the server exports, and probe real endpoints."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml

from frontend.engine.async_llm import AsyncLLM
from frontend.engine.client import AsyncEngineClient
from frontend.metrics import EngineStatsCollector, Metrics, RequestTiming, render
from frontend.openai.serving import OpenAIServing
from frontend.server.app import build_app
from frontend.server.deps import AppDeps, ServerConfig
from protocol.messages import ModelInfo, RequestOutput, SchedulerStats

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
INFO = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0")
METRIC = re.compile(r"engine:[a-z_]+")


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every sample name /metrics can carry (histograms as _bucket/_sum/_count, counters as _total)."""
    metrics = Metrics(INFO)
    timing = RequestTiming(0.0)  # one observation each, so every labelled series exists
    metrics.observe_token(timing, 1.0, 1)
    metrics.observe_token(timing, 1.1, 1)
    metrics.observe_finished(timing, RequestOutput("r", [1]), "stop", 3, 2, 2.0, n=1, max_tokens=16)
    metrics.observe_pooling(0.0, RequestOutput("p", [], finish_reason="stop"), 5, "embed")
    metrics.http_requests.labels("POST", "/v1/completions", "200").inc()
    metrics.http_latency.labels("POST", "/v1/completions").observe(0.1)
    metrics.mm_cache_queries.labels("m").inc()
    metrics.mm_cache_hits.labels("m").inc()
    text = render(EngineStatsCollector(lambda: [SchedulerStats()], "m")).decode()
    names = set(re.findall(r"^(engine:[a-z_]+)", text, flags=re.M))
    assert "engine:num_requests_waiting" in names and "engine:time_to_first_token_seconds_bucket" in names
    return names


def manifests() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def test_every_yaml_parses() -> None:
    kinds = {d.get("kind") for d in manifests()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds


def test_dashboard_queries_only_exported_metrics(exported: set[str]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "engine-dashboard.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(METRIC.findall(target["expr"]))
    assert queried and queried <= exported, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "first token",
        "inter-token",
        "queue",
        "kv cache",
        "preemption",
        "throughput",
        "prefix cache",
        "time per output token",
        "per engine step",
        "embeddings",
        "images",
    ):
        assert topic in titles


def test_autoscaling_and_scrape_use_exported_metrics(exported: set[str]) -> None:
    adapter = (DEPLOY / "k8s" / "prometheus-adapter.yaml").read_text()
    assert set(METRIC.findall(adapter)) <= exported
    hpa = next(
        d
        for d in manifests()
        if d.get("kind") == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "engine"
    )
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "engine_num_requests_waiting"
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_probes_point_at_real_endpoints() -> None:
    client = AsyncEngineClient("ipc:///tmp/engine-deploy-test-in", "ipc:///tmp/engine-deploy-test-out")
    app = build_app(
        AppDeps(
            ServerConfig(model="m", input_address="", output_address=""),
            OpenAIServing(AsyncLLM(client, None), INFO),
        )
    )
    routes = set(app.openapi()["paths"])
    client.close()
    probes = 0
    for doc in manifests():
        if doc.get("kind") != "Deployment":
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = container.get(probe)
            if spec and "httpGet" in spec:
                assert spec["httpGet"]["path"] in routes, spec
                probes += 1
    assert probes >= 6


def test_nginx_streams_unbuffered() -> None:
    conf = (DEPLOY / "nginx" / "engine.conf").read_text()
    assert "proxy_buffering off" in conf and re.search(r"proxy_read_timeout\s+\d{3,}s", conf)
