"""The side-by-side report of `make bench-peers`: its table and its plot, from a report shaped like a
real run (the peers themselves run only in `make bench-peers`, never in the suite)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import psutil

from benchmarks import performance_page
from benchmarks.peers import PeakRss, bench_args, combine_rounds, plot, table, turn_order, workloads
from tests.serve_helpers import wait_until


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
            "ours": {
                "runs": {n: summary(200.0, 0.1) for n in names},
                "peak_rss_mib": 900.0,
                "startup_s": 10.0,
            },
            "vllm": {
                "runs": {n: summary(100.0, 0.2) for n in names},
                "peak_rss_mib": 1800.0,
                "startup_s": 100.0,
            },
            "llamacpp": {"error": "did not start", "runs": {}},
        },
    }


def test_table_gives_each_figure_and_ours_over_peer() -> None:
    text = table(report())
    lines = text.splitlines()
    assert lines[0].startswith("| workload | figure | engine | vLLM (CPU) | llama.cpp | ours/vLLM (CPU) |")
    assert "| random c=16 | output tok/s | 200.0 | 100.0 | n/a | 2.00x | n/a |" in lines
    assert "| random c=1 | TTFT p50 (ms) | 100.0 | 200.0 | n/a | 0.50x | n/a |" in lines
    assert "| whole run | peak RSS, process tree (MiB) | 900.0 | 1800.0 | n/a | 0.50x | n/a |" in lines
    assert "| whole run | startup (s) | 10.0 | 100.0 | n/a | 0.10x | n/a |" in lines
    assert len(lines) == 2 + 3 * 7 + 2


def test_rounds_combine_into_medians_and_the_worst_memory() -> None:
    names = ["random c=16"]

    def round_(tok_s: float, ttft_s: float, rss: float) -> dict:  # type: ignore[type-arg]
        return {"runs": {n: summary(tok_s, ttft_s) for n in names}, "peak_rss_mib": rss, "startup_s": 10.0}

    rounds = [
        round_(300.0, 0.4, 900.0),
        {"error": "exited", "runs": {}},
        round_(500.0, 0.2, 950.0),
        round_(400.0, 0.9, 920.0),
    ]
    combined = combine_rounds(rounds)
    run = combined["runs"]["random c=16"]
    assert run["output_throughput"] == 400.0 and run["ttft_s"]["p50"] == 0.4 and run["ttft_s"]["p99"] == 0.8
    assert combined["peak_rss_mib"] == 950.0 and combined["rounds"] == rounds
    failed = combine_rounds([{"error": "exited", "runs": {}}])
    assert failed["error"] == "exited" and failed["runs"] == {}


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
    # Side by side a server keeps its prefix cache across rounds: every round's prompts are new.
    seeds = [w["seed"] for index in range(4) for w in workloads(args, index)]
    assert len(set(seeds)) == len(seeds) == 16


def test_a_run_is_named_by_the_concurrency_its_prompts_reach() -> None:
    # 32 prompts at c=64 never hold 64 open: the table must not call that run c=64 (run Y's c=64 row did).
    args = argparse.Namespace(
        concurrency=[1, 16, 32, 64], input_len=100, output_len=128, num_prompts=32, prefix_len=512, seed=7
    )
    runs = workloads(args)
    assert [w["name"] for w in runs] == ["random c=1", "random c=16", "random c=32", "shared-prefix c=16"]
    assert [w["max_concurrency"] for w in runs] == [1, 16, 32, 16]
    args.num_prompts, args.concurrency = 8, [1, 64]  # --quick-sized
    assert [w["name"] for w in workloads(args)] == ["random c=1", "random c=8", "shared-prefix c=8"]


def test_side_by_side_turns_alternate_who_goes_first() -> None:
    servers = ["ours", "vllm", "llamacpp"]
    assert [turn_order(servers, index)[0] for index in range(4)] == ["ours", "llamacpp", "ours", "llamacpp"]
    assert turn_order(servers, 1) == ["llamacpp", "vllm", "ours"] and servers == ["ours", "vllm", "llamacpp"]


def test_peak_rss_counts_the_whole_process_tree() -> None:
    # A parent holding ~20 MiB with a child holding ~60 MiB: the tree's peak is their sum, not the parent's.
    child = "import sys, time; b = bytearray(60 << 20); sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(60)"
    parent = (
        f"import subprocess, sys; b = bytearray(20 << 20); c = subprocess.Popen([sys.executable, '-c', {child!r}], "
        "stdout=subprocess.PIPE); sys.stdout.write(c.stdout.readline().decode()); sys.stdout.flush(); c.wait()"
    )
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    root = psutil.Process(process.pid)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        own = root.memory_info().rss
        rss = PeakRss(process.pid, interval=0.05)
        wait_until(lambda: rss.peak_bytes >= own + (60 << 20), 10, "the sampler to see the child's memory")
        assert rss.stop() >= 80  # MiB
    finally:
        for p in [*root.children(recursive=True), root]:
            p.kill()
        process.wait()


def test_side_by_side_keeps_going_when_a_server_fails(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The orchestration only: each "server" a real sleeping process (so stopping and RSS sampling run
    # for real), the benchmark pass replaced; vLLM's pass fails in the second round.
    import benchmarks.peers as peers

    started: list[subprocess.Popen[bytes]] = []

    def start_server(name, cache, hf, port):  # type: ignore[no-untyped-def]
        process = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        started.append(process)
        return process, 1.0

    calls: list[tuple[int, str, str]] = []

    def run_workload(name, port, workload):  # type: ignore[no-untyped-def]
        round_index = (workload["seed"] - 7) // 100_003
        calls.append((round_index, workload["name"], name))
        if name == "vllm" and round_index == 1:
            raise RuntimeError("connection refused")
        return summary(100.0, 0.1)

    monkeypatch.setattr(peers, "start_server", start_server)
    monkeypatch.setattr(peers, "run_workload", run_workload)
    args = argparse.Namespace(
        servers=["ours", "vllm"], rounds=3, port=18123, concurrency=[16], input_len=100, output_len=128,
        num_prompts=64, prefix_len=512, seed=7,
    )  # fmt: skip
    rounds = peers.side_by_side(args, None, None)  # type: ignore[arg-type]

    assert [name for r, w, name in calls if w == "random c=16"] == ["ours", "vllm", "vllm", "ours", "ours"]
    assert len(rounds["ours"]) == 3 and all("error" not in r for r in rounds["ours"])
    assert [("error" in r) for r in rounds["vllm"]] == [False, True]  # round 1, then the failure
    assert all(process.poll() is not None for process in started)  # every server stopped
    combined = combine_rounds(rounds["vllm"])
    assert combined["runs"]["random c=16"]["output_throughput"] == 100.0


def test_the_performance_page_keeps_one_table_per_cpu_kind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert performance_page.cpu_kind("Intel(R) Xeon(R) Processor", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == (
        "amx", "Intel Xeon Processor (AVX-512 BF16 and AMX)",
    )  # fmt: skip
    assert performance_page.cpu_kind("AMD EPYC 9R14", {"avx2", "avx512f", "avx512_bf16"})[0] == "avx512-bf16"
    assert performance_page.cpu_kind("AMD EPYC 7R13", {"avx2", "fma"})[0] == "avx2"
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n## Where we stand\n\ntext\n\n## What runs on the CPU\n\nmore\n")
    text = table(report())

    def put(key: str, title: str, date: str) -> str:
        run = report() | {"date": date}
        section = performance_page.section(key, title, run, text, "python -m benchmarks.peers")
        page.write_text(performance_page.update(page.read_text(), key, section))
        return page.read_text()

    first = put("amx", "Xeon (AMX)", "2026-12-05")
    assert first.index(performance_page.HEADING) < first.index("### Xeon (AMX): 2026-12-05")
    assert first.index("### Xeon (AMX)") < first.index("## What runs on the CPU")  # before the next part
    both = put("avx2", "EPYC (AVX2)", "2026-12-06")
    again = put("amx", "Xeon (AMX)", "2026-12-07")  # the kind's table replaced, the other kind's kept
    assert (
        again.count("<!-- bench-peers:amx -->") == 1 and "2026-12-05" not in again and "2026-12-07" in again
    )
    assert again.count("### EPYC (AVX2): 2026-12-06") == 1 and again.count(performance_page.HEADING) == 1
    assert again.count("| random c=16 | output tok/s | 200.0 | 100.0 | n/a | 2.00x | n/a |") == 2
    assert again.endswith("more\n") and both.startswith("# Performance")
