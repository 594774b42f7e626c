"""`engine bench throughput` and `engine bench latency`: the offline engine (the `LLM` API, real engine
and worker processes), no HTTP. Like vLLM's commands of the same names.

throughput: every prompt submitted at once; requests/s, total and output tokens/s.
latency: one batch, generated again and again; seconds per batch (mean and percentiles).
Prompts are random token ids (fresh ones each latency iteration, so no prefix cache helps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any


def random_prompts(count: int, mean_len: int, range_ratio: float, rng: random.Random) -> list[list[int]]:
    low = max(1, int(mean_len * (1 - range_ratio)))
    high = max(low, int(mean_len * (1 + range_ratio)))
    return [[rng.randrange(1000, 20000) for _ in range(rng.randint(low, high))] for _ in range(count)]


def throughput(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_input = sum(len(p) for p in prompts)
    num_output = sum(len(r.outputs[0].token_ids) for r in results)
    return {
        "num_requests": len(prompts),
        "elapsed_s": elapsed,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
    }


def latency(llm: Any, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def one_batch() -> float:
        prompts = random_prompts(args.batch_size, args.input_len, 0.0, rng)
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
        assert all(len(r.outputs[0].token_ids) == args.output_len for r in results)
        return elapsed

    for _ in range(args.num_iters_warmup):
        one_batch()
    latencies = [one_batch() for _ in range(args.num_iters)]
    ordered = sorted(latencies)
    percentiles = {
        f"p{q}": ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
        for q in (10, 25, 50, 75, 90, 99)
    }
    return {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "latencies_s": latencies,
        "avg_latency_s": statistics.fmean(latencies),
        "percentiles_s": percentiles,
        "output_tokens_per_s": args.batch_size * args.output_len / statistics.fmean(latencies),
    }


def _llm(args: argparse.Namespace) -> Any:
    from frontend.config.engine_args import EngineArgs
    from frontend.config.flags import from_namespace
    from frontend.offline.llm import LLM

    return LLM.from_engine_args(from_namespace(EngineArgs, args))


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    prompts = random_prompts(
        args.num_prompts, args.input_len, args.range_ratio, random.Random(args.prompt_seed)
    )
    with _llm(args) as llm:
        report = throughput(llm, prompts, args.output_len)
    print(
        f"Throughput: {report['requests_per_s']:.2f} requests/s, "
        f"{report['total_tokens_per_s']:.2f} total tokens/s, {report['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(
        f"{report['num_requests']} requests, {report['total_input_tokens']} prompt + "
        f"{report['total_output_tokens']} output tokens in {report['elapsed_s']:.2f} s"
    )
    _write(args, report)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    with _llm(args) as llm:
        report = latency(llm, args, random.Random(args.prompt_seed))
    print(f"Avg latency: {report['avg_latency_s']:.4f} s (batch {args.batch_size}, {args.output_len} tokens)")
    for name, value in report["percentiles_s"].items():
        print(f"{name} latency: {value:.4f} s")
    print(f"Output tokens/s: {report['output_tokens_per_s']:.2f}")
    _write(args, report)
    return 0


def add_offline_bench_parsers(kinds: Any) -> None:
    from frontend.config.engine_args import EngineArgs
    from frontend.config.flags import add_flags

    run = kinds.add_parser("throughput", help="offline engine throughput (all prompts at once, no HTTP)")
    add_flags(run, EngineArgs)
    run.add_argument("--num-prompts", type=int, default=64)
    run.add_argument("--input-len", type=int, default=100)
    run.add_argument("--output-len", type=int, default=128)
    run.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths in mean*(1±ratio)")
    run.add_argument("--prompt-seed", type=int, default=0)
    run.add_argument("--output-json", default=None)
    run.set_defaults(func=cmd_bench_throughput)

    lat = kinds.add_parser("latency", help="offline latency of one batch, many iterations (no HTTP)")
    add_flags(lat, EngineArgs)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--prompt-seed", type=int, default=0)
    lat.add_argument("--output-json", default=None)
    lat.set_defaults(func=cmd_bench_latency)
