"""`engine bench engine --address ADDRESS`: load a running EngineCore directly over ZMQ.

The harness registers with the engine as one more frontend (as `engine serve --attach` does) and sends
token ids, so neither HTTP nor tokenization is measured. With `--compare-base-url` it then sends the same
requests through an API server of that engine and prints the difference: the frontend's cost.
`--rounds N` repeats the pair N times, the two paths taking turns going first, and reports the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from dataclasses import asdict
from typing import Any

import uvloop

from frontend.bench.serve import (
    BenchRequest,
    Result,
    add_workload_args,
    drive,
    first_model,
    random_requests,
    run,
    summarize,
    table,
)
from frontend.engine.async_llm import AsyncLLM, new_request_id
from frontend.engine.client import AsyncEngineClient
from frontend.launcher import engine_addresses
from protocol.sampling import SamplingParams


async def send_tokens(llm: AsyncLLM, args: argparse.Namespace, request: BenchRequest) -> Result:
    """One request through the output path every door uses (no tokenizer: token ids only)."""
    prompt = request.prompt
    assert isinstance(prompt, list)
    params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=args.ignore_eos)
    result = Result(ok=False, prompt_len=request.prompt_len)
    start = time.perf_counter()
    last = start

    async def consume() -> None:
        nonlocal last
        async for _, delta in llm.generate(new_request_id(llm.client.client_id), prompt, params):
            if delta.token_ids:
                now = time.perf_counter()
                if result.output_tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
                result.output_tokens += len(delta.token_ids)

    try:
        await asyncio.wait_for(consume(), args.timeout if args.timeout else None)
    except TimeoutError:
        result.error = f"not finished within {args.timeout} s"
        return result
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = True
    return result


async def run_engine(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[list[Result], float, dict[str, Any]]:
    input_address, output_address = engine_addresses(args.address)
    client = AsyncEngineClient(input_address, output_address, client_id=f"bench-{uuid.uuid4().hex[:8]}")
    llm = AsyncLLM(client, tokenizer=None)
    try:
        info = await client.register(timeout_s=args.connect_timeout)
        results, duration = await drive(args, requests, lambda request: send_tokens(llm, args, request))
    finally:
        client.close()
    return results, duration, {"model": info.model, "dtype": info.dtype, "max_model_len": info.max_model_len}


def frontend_cost(engine: dict[str, Any], serve: dict[str, Any]) -> dict[str, float]:
    """What the HTTP path adds at the same load: latency differences (s) and the throughput ratio."""
    return {
        "ttft_mean_s": serve["ttft_s"]["mean"] - engine["ttft_s"]["mean"],
        "ttft_p99_s": serve["ttft_s"]["p99"] - engine["ttft_s"]["p99"],
        "itl_mean_s": serve["itl_s"]["mean"] - engine["itl_s"]["mean"],
        "e2el_mean_s": serve["e2el_s"]["mean"] - engine["e2el_s"]["mean"],
        "output_throughput_ratio": (
            serve["output_throughput"] / engine["output_throughput"] if engine["output_throughput"] else 0.0
        ),
    }


def median_cost(costs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds (one round: that round's figures)."""
    return {name: statistics.median(cost[name] for cost in costs) for name in costs[0]}


def engine_pass(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    requests = random_requests(args, random.Random(seed))
    results, duration, info = uvloop.run(run_engine(args, requests))
    summary = summarize(args, results, duration, args.address)
    summary["model"] = info
    return {"summary": summary, "results": results}


def serve_pass(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    serve_args = argparse.Namespace(**{**vars(args), "base_url": args.compare_base_url})
    requests = random_requests(args, random.Random(seed))
    results, duration = uvloop.run(run(serve_args, requests))
    return {"summary": summarize(serve_args, results, duration, args.compare_base_url), "results": results}


def print_cost(cost: dict[str, float]) -> None:
    print(
        f"{'TTFT mean / p99 (ms):':<36}{1000 * cost['ttft_mean_s']:+.1f} / {1000 * cost['ttft_p99_s']:+.1f}"
    )
    print(f"{'ITL mean (ms):':<36}{1000 * cost['itl_mean_s']:+.2f}")
    print(f"{'E2E mean (ms):':<36}{1000 * cost['e2el_mean_s']:+.1f}")
    print(f"{'Output throughput, HTTP / ZMQ:':<36}{cost['output_throughput_ratio']:.3f}")


def cmd_bench_engine(args: argparse.Namespace) -> int:
    args.endpoint = "completions"  # token-id prompts
    if args.rounds < 1 or (args.rounds > 1 and not args.compare_base_url):
        raise SystemExit("--rounds takes a count >= 1, and more than one round needs --compare-base-url")
    if args.compare_base_url:
        args.model = args.served_model_name or first_model(args.compare_base_url, args.api_key)
    # Every pass gets fresh prompts of the same shapes, so the engine's prefix cache favours none; in
    # rounds the two paths take turns going first (ZMQ, HTTP, HTTP, ZMQ, ...), so a machine that speeds
    # up or slows down over the run does not tilt the ratio one way.
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        seeds = (args.seed + 2 * index * 7919, args.seed + (2 * index + 1) * 7919)
        kinds = ["engine", "serve"] if args.compare_base_url else ["engine"]
        passes: dict[str, dict[str, Any]] = {}
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            passes[kind] = engine_pass(args, seeds[0]) if kind == "engine" else serve_pass(args, seeds[1])
        rounds.append(passes)
    first = rounds[0]
    summary = first["engine"]["summary"]
    print(f"engine at {args.address} (ZMQ, token ids; no HTTP, no tokenizer)")
    print(table(summary))
    report: dict[str, Any] = {"summary": summary, "requests": [asdict(r) for r in first["engine"]["results"]]}
    failed = sum(p["summary"]["failed"] for passes in rounds for p in passes.values())
    if args.compare_base_url:
        costs = [frontend_cost(p["engine"]["summary"], p["serve"]["summary"]) for p in rounds]
        print(f"\nthe same requests through {args.compare_base_url} (HTTP, SSE)")
        print(table(first["serve"]["summary"]))
        cost = median_cost(costs)
        if args.rounds > 1:
            print(f"\nfrontend cost (HTTP minus ZMQ, same load), the median of {args.rounds} rounds")
            ratios = ", ".join(f"{c['output_throughput_ratio']:.3f}" for c in costs)
            print(f"{'Output throughput ratio by round:':<36}{ratios}")
        else:
            print("\nfrontend cost (HTTP minus ZMQ, same load)")
        print_cost(cost)
        report.update(serve_summary=first["serve"]["summary"], frontend_cost=cost)
        if args.rounds > 1:
            report["rounds"] = [
                {
                    "summary": p["engine"]["summary"],
                    "serve_summary": p["serve"]["summary"],
                    "frontend_cost": c,
                }
                for p, c in zip(rounds, costs, strict=True)
            ]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if failed == 0 else 1


def add_engine_bench_parser(kinds: Any) -> None:
    engine = kinds.add_parser(
        "engine", help="load a running EngineCore over ZMQ with token ids (no HTTP, no tokenizer)"
    )
    engine.add_argument(
        "--address", required=True, help="the engine's --engine-address (tcp://HOST:PORT or ipc://PATH)"
    )
    engine.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the engine")
    engine.add_argument(
        "--compare-base-url", default=None, help="also send the same requests through this API server"
    )
    engine.add_argument("--served-model-name", default=None, help="model name for --compare-base-url")
    engine.add_argument("--api-key", default=None, help="for --compare-base-url")
    engine.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --compare-base-url: this many ZMQ and HTTP passes, taking turns; the medians are reported",
    )
    add_workload_args(engine, ("random", "shared-prefix"))
    engine.set_defaults(func=cmd_bench_engine)
