"""The side-by-side report of `make bench-peers`: its table and its plot, from a report shaped like a
real run (the peers themselves run only in `make bench-peers`, never in the suite)."""

from __future__ import annotations

import argparse

from benchmarks.peers import bench_args, plot, table, workloads


def summary(tok_s: float, ttft_s: float) -> dict:  # type: ignore[type-arg]
    stats = {"mean": ttft_s, "p50": ttft_s, "p90": ttft_s, "p99": 2 * ttft_s}
    return {
        "output_throughput": tok_s,
        "request_throughput": tok_s / 128,
        "ttft_s": stats,
        "tpot_s": stats,
        "itl_s": stats,
        "e2el_s": stats,
    }


def report() -> dict:  # type: ignore[type-arg]
    names = ["random c=1", "random c=16", "shared-prefix c=16"]
    return {
        "date": "2026-11-29",
        "machine": {"cpus": 2},
        "workloads": names,
        "servers": {
            "ours": {"runs": {n: summary(200.0, 0.1) for n in names}},
            "vllm": {"runs": {n: summary(100.0, 0.2) for n in names}},
            "llamacpp": {"error": "did not start", "runs": {}},
        },
    }


def test_table_gives_each_figure_and_ours_over_peer() -> None:
    text = table(report())
    lines = text.splitlines()
    assert lines[0].startswith("| workload | figure | engine | vLLM (CPU) | llama.cpp | ours/vLLM (CPU) |")
    assert "| random c=16 | output tok/s | 200.0 | 100.0 | n/a | 2.00x | n/a |" in lines
    assert "| random c=1 | TTFT p50 (ms) | 100.0 | 200.0 | n/a | 0.50x | n/a |" in lines
    assert len(lines) == 2 + 3 * 7


def test_plot_writes_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "peers.png"
    plot(report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_run_has_its_own_prompt_seed() -> None:
    args = argparse.Namespace(
        concurrency=[1, 16, 64], input_len=100, output_len=128, num_prompts=64, prefix_len=512, seed=7
    )
    runs = workloads(args)
    assert [w["name"] for w in runs] == ["random c=1", "random c=16", "random c=64", "shared-prefix c=16"]
    assert len({w["seed"] for w in runs}) == len(runs)
    first = bench_args("http://x", runs[0])
    assert first.max_concurrency == 1 and first.ignore_eos and first.num_prompts == 64 and first.seed == 7
