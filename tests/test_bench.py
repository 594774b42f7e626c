"""The benchmark harnesses against a real server: `bench engine` (ZMQ, token ids) and `bench serve`
(HTTP) count exactly the tokens the server's own /metrics counts; `bench throughput` / `bench latency`
run the offline engine."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import httpx
import pytest

from tests.serve_helpers import free_engine_port, free_port, stop, wait_until

pytestmark = pytest.mark.slow


def counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for name, value in re.findall(r"^(engine:[a-z_]+_total)\{[^}]*\} ([0-9.e+]+)$", text, flags=re.M):
        values[name] = values.get(name, 0.0) + float(value)
    return values


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "frontend.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.long  # make test-long
def test_zmq_harness_and_bench_serve_agree_with_metrics(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port, engine_port = free_port(), free_engine_port()
    address = f"tcp://127.0.0.1:{engine_port}"
    server = subprocess.Popen(
        [
            sys.executable, "-m", "frontend.cli", "serve", smollm2_gguf, "--port", str(port),
            "--engine-address", address, "--dtype", "float32", "--max-model-len", "256",
            "--num-kv-blocks", "256", "--stats-log-interval", "0",
        ]
    )  # fmt: skip
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, 180, "the server")
        before = counters(port)
        out = tmp_path / "engine.json"
        run = bench(
            "engine", "--address", address, "--compare-base-url", f"http://127.0.0.1:{port}",
            "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "24", "--range-ratio", "0.5",
            "--output-len", "6", "--ignore-eos", "--warmup", "0", "--quiet", "--output-json", str(out),
            "--rounds", "2",
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "frontend cost" in run.stdout and "the median of 2 rounds" in run.stdout
        report = json.loads(out.read_text())
        rounds = report["rounds"]
        assert len(rounds) == 2 and rounds[0]["summary"] == report["summary"]
        ratios = [r["frontend_cost"]["output_throughput_ratio"] for r in rounds]
        assert report["frontend_cost"]["output_throughput_ratio"] == pytest.approx(statistics.median(ratios))
        zmq = [r["summary"] for r in rounds]
        http = [r["serve_summary"] for r in rounds]
        for summary in zmq + http:
            assert summary["completed"] == 6 and summary["ttft_s"]["p50"] > 0
            assert summary["total_output_tokens"] >= 18  # ignore_eos, 3..9 each

        def delta(name: str) -> float:
            return counters(port).get(name, 0.0) - before.get(name, 0.0)

        # Engine-wide counters see both harnesses; they reach /metrics with the next stats message.
        generated = sum(s["total_output_tokens"] for s in zmq + http)
        wait_until(lambda: delta("engine:engine_generation_tokens_total") == generated, 10, "engine counters")
        computed = delta("engine:engine_prompt_tokens_computed_total") + delta(
            "engine:prefix_cache_hits_total"
        )
        assert computed == sum(s["total_input_tokens"] for s in zmq + http)
        # Every pass had prompts of its own: no pass was served from another's prefix cache.
        assert delta("engine:prefix_cache_hits_total") == 0
        # Per-request counters belong to the API servers: exactly the HTTP passes.
        assert delta("engine:prompt_tokens_total") == sum(s["total_input_tokens"] for s in http)
        assert delta("engine:generation_tokens_total") == sum(s["total_output_tokens"] for s in http)
        assert delta("engine:request_success_total") == 12

        # A refused request is a failure with the server's answer, and the run's status says so.
        out = tmp_path / "refused.json"
        run = bench(
            "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "no-such-model", "--endpoint",
            "chat", "--num-prompts", "2", "--warmup", "0", "--quiet", "--output-json", str(out),
        )  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr
        summary = json.loads(out.read_text())["summary"]
        assert summary["failed"] == 2 and summary["errors"][0].startswith("HTTP 404"), summary

        # The Responses door, store: true against store: false in one run, counts the server's tokens.
        before = counters(port)
        out = tmp_path / "responses.json"
        run = bench(
            "serve", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "responses",
            "--responses-store", "both", "--num-prompts", "3", "--max-concurrency", "3", "--input-len", "8",
            "--output-len", "4", "--range-ratio", "0", "--ignore-eos", "--warmup", "0", "--quiet",
            "--output-json", str(out),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads(out.read_text())
        # ignore_eos is honoured on this door too: every answer runs to its 4 tokens
        assert all(r["output_tokens"] == 4 for r in report["requests"]), report["requests"]
        passes = [report["summary"], report["no_store_summary"]]
        assert [(s["store"], s["completed"]) for s in passes] == [(True, 3), (False, 3)]
        generated = sum(s["total_output_tokens"] for s in passes)
        wait_until(lambda: delta("engine:generation_tokens_total") == generated, 10, "the server's counters")
        assert "Output throughput, true / false:" in run.stdout
    finally:
        stop(server)


def test_rounds_need_a_comparison() -> None:
    run = bench("engine", "--address", "tcp://127.0.0.1:9", "--rounds", "3")
    assert run.returncode != 0 and "needs --compare-base-url" in run.stderr


@pytest.mark.long  # make test-long
def test_offline_throughput_and_latency(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    common = [smollm2_gguf, "--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64"]
    out = tmp_path / "throughput.json"
    run = bench(
        "throughput", *common, "--num-prompts", "5", "--input-len", "12", "--output-len", "4",
        "--output-json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["num_requests"] == 5 and report["total_input_tokens"] == 60
    assert report["total_output_tokens"] == 20 and report["output_tokens_per_s"] > 0
    assert "Throughput:" in run.stdout

    out = tmp_path / "latency.json"
    run = bench(
        "latency", *common, "--batch-size", "2", "--input-len", "8", "--output-len", "3",
        "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert len(report["latencies_s"]) == 3 and report["avg_latency_s"] > 0
    assert report["percentiles_s"]["p99"] >= report["percentiles_s"]["p10"]


@pytest.mark.long  # make test-long
def test_startup_times_cold_and_warm_starts_with_their_phases(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "startup.json"
    run = bench(
        "startup", "--num-iters-cold", "1", "--num-iters-warmup", "1", "--num-iters-warm", "1",
        "--output-json", str(out), "--", smollm2_gguf, "--max-model-len", "256",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["cold"]["starts"] == 1 and report["warm"]["starts"] == 1
    for mode in ("cold", "warm"):
        (start,) = report[mode]["runs"]
        phases = start["phases"]
        assert {"launcher", "engine", "worker", "API server 0"} <= set(phases), phases
        assert phases["worker"]["imports"] > 0 and phases["launcher"]["total"] > 0
        # /health answers once the API server is ready, which waits for the engine, which waits for the worker
        assert start["healthy_s"] >= phases["API server 0"]["total"] >= phases["worker"]["total"]
    # the warm start reads the conversion the cold one wrote into its own folder: the worker's config is quick
    assert (
        report["warm"]["runs"][0]["phases"]["worker"]["config"]
        < report["cold"]["runs"][0]["phases"]["worker"]["config"]
    )
    assert "warm: /health after" in run.stdout
    run = bench("startup", "--", smollm2_gguf, "--port", "8000")
    assert run.returncode != 0 and "picks --port" in run.stderr


@pytest.mark.long  # make test-long
def test_lockstep_runs_every_variant_to_the_end(smollm2_gguf: str) -> None:
    """benchmarks.lockstep: each variant decodes the same prompts to the end with its own block size, and
    a `:4k` variant's KV cache is not the huge-page buffer the worker allocates."""
    from benchmarks import lockstep
    from tests.test_host_memory import mapping_of

    argv = ["--model", smollm2_gguf, "--variants", "16:4k", "64", "--concurrency", "2", "--input-len", "20"]
    variants = lockstep.main([*argv, "--output-len", "4", "--rounds", "1", "--kv-tokens", "1024"])
    assert [(v.name, v.block_size, v.default_pages) for v in variants] == [
        ("16:4k", 16, True),
        ("64", 64, False),
    ]
    for variant in variants:
        assert variant.core is not None and not variant.core.has_unfinished_requests()
        assert variant.core.scheduler.num_generation_tokens == 2 * 4
        assert len(variant.decode_ms) == 3  # both prompts in the first step, then three decode steps
        runner = variant.core.executor.runner  # type: ignore[attr-defined]
        assert runner.kv_caches[0].shape[2] == variant.block_size
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
            advised = "hg" in mapping_of(runner.kv_caches[0].data_ptr())["VmFlags"].split()
            assert advised != variant.default_pages


@pytest.mark.parametrize(
    "module",
    [
        "burst_ttft",
        "dp_routing",
        "cpu_kernels",
        "lockstep",
        "offline_throughput",
        "parallel_overhead",
        "parallel_serve",
        "peers",
        "profile_step",
    ],
)
def test_every_benchmark_prints_its_help(module: str) -> None:
    """argparse formats each help string with `%` at `--help` time only, so a stray `%` (lockstep's
    `+-10%`) broke the help and nothing else."""
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: "), run.stdout
