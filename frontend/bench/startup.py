"""`engine bench startup [serve flags]`: seconds from `engine serve` to its first `/health` 200, cold and warm.

As `vllm bench startup`: cold starts run with an empty cache folder (`--cache-dir` a new temporary folder: the
GGUF file's tokenizer and weights converted again, as on the first start after install; the csrc kernels,
built by `make install`, are kept), warm starts share one folder, filled by `--num-iters-warmup` starts that
are not counted. Each start's phases are read from the processes' `startup` log lines (launcher, engine,
worker, API server), so the table says where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

# "engine.worker: worker startup 1.48 s: imports 1.06, config 0.01, ..."
PHASES_LINE = re.compile(r"engine\.\w+: (?P<process>[\w ]+?) startup (?P<total>[\d.]+) s: (?P<phases>.*)$")


def add_startup_bench_parser(kinds: Any) -> None:
    parser = kinds.add_parser(
        "startup",
        help="seconds from `engine serve` to /health, cold and warm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--num-iters-cold", type=int, default=3, help="starts, each with an empty cache folder"
    )
    parser.add_argument(
        "--num-iters-warmup", type=int, default=1, help="uncounted starts that fill the cache"
    )
    parser.add_argument("--num-iters-warm", type=int, default=3, help="starts on the filled cache folder")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after `--`: `engine serve`'s model and flags"
    )
    parser.set_defaults(func=main)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT, as Ctrl-C would, then the whole session if it does not end."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def one_start(serve_args: list[str], cache_dir: str, timeout: float) -> dict[str, Any]:
    """One `engine serve` until /health answers 200: the seconds, and each process's startup phases."""
    port = free_port()
    command = [sys.executable, "-m", "frontend.cli", "serve", *serve_args, "--port", str(port),
               "--host", "127.0.0.1", "--cache-dir", cache_dir]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not healthy(f"http://127.0.0.1:{port}/health"):
                if process.poll() is not None or time.perf_counter() - start > timeout:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise SystemExit(f"engine serve did not become healthy (exit {process.poll()}):\n{tail}")
                time.sleep(0.01)
            seconds = time.perf_counter() - start
        finally:
            stop(process)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    phases: dict[str, dict[str, float]] = {}
    for line in lines:
        match = PHASES_LINE.search(line)
        if match:
            parts = dict(part.rsplit(" ", 1) for part in match["phases"].split(", ") if " " in part)
            phases[match["process"]] = {"total": float(match["total"])} | {
                name: float(value) for name, value in parts.items()
            }
    return {"healthy_s": seconds, "phases": phases}


def summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    times = [start["healthy_s"] for start in starts]
    processes: dict[str, dict[str, list[float]]] = {}
    for start in starts:
        for process, phases in start["phases"].items():
            for phase, value in phases.items():
                processes.setdefault(process, {}).setdefault(phase, []).append(value)
    return {
        "starts": len(starts),
        "healthy_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "phases_median_s": {
            process: {phase: statistics.median(values) for phase, values in phases.items()}
            for process, phases in processes.items()
        },
        "runs": starts,
    }


def main(args: argparse.Namespace) -> int:
    serve_args = [arg for arg in args.serve_args if arg != "--"]
    if any(arg.startswith(("--port", "--cache-dir", "--host")) for arg in serve_args):
        raise SystemExit("engine bench startup picks --port, --host and --cache-dir itself: leave them out")
    report: dict[str, Any] = {"serve_args": serve_args}
    cold = []
    for _ in range(args.num_iters_cold):
        folder = tempfile.mkdtemp(prefix="engine-startup-cold-")
        try:
            cold.append(one_start(serve_args, folder, args.timeout))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    warm_folder = tempfile.mkdtemp(prefix="engine-startup-warm-")
    try:
        for _ in range(args.num_iters_warmup):
            one_start(serve_args, warm_folder, args.timeout)
        warm = [one_start(serve_args, warm_folder, args.timeout) for _ in range(args.num_iters_warm)]
    finally:
        shutil.rmtree(warm_folder, ignore_errors=True)
    for mode, starts in (("cold", cold), ("warm", warm)):
        if not starts:
            continue
        report[mode] = summary(starts)
        seconds = report[mode]["healthy_s"]
        print(f"{mode}: /health after {seconds['median']:.2f} s (median of {len(starts)}; "
              f"{seconds['min']:.2f}-{seconds['max']:.2f})")  # fmt: skip
        for process, phases in report[mode]["phases_median_s"].items():
            parts = ", ".join(f"{name} {value:.2f}" for name, value in phases.items() if name != "total")
            print(f"  {process:<14} {phases['total']:.2f} s: {parts}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
