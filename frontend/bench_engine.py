"""`engine bench engine --address ADDRESS`: load a running EngineCore directly over ZMQ.

The harness registers with the engine as one more frontend (as `engine serve --attach` does) and sends
token ids, so neither HTTP nor tokenization is measured. With `--compare-base-url` it then sends the same
requests through an API server of that engine and prints the difference: the frontend's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import asdict
from typing import Any

import uvloop

from frontend.async_client import AsyncEngineClient
from frontend.bench_serve import (
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
from frontend.launcher import engine_addresses
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams


async def send_tokens(client: AsyncEngineClient, args: argparse.Namespace, request: BenchRequest) -> Result:
    assert isinstance(request.prompt, list)
    request_id = f"{client.client_id}-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=args.ignore_eos)
    result = Result(ok=False, prompt_len=request.prompt_len)
    start = time.perf_counter()
    last = start
    try:
        queue = await client.add_request(
            AddRequest(
                request_id=request_id,
                prompt_token_ids=request.prompt,
                sampling_params=params,
                arrival_time=time.time(),
            )
        )
        while True:
            output = await asyncio.wait_for(queue.get(), args.timeout)
            if isinstance(output, Exception):
                result.error = f"{type(output).__name__}: {output}"
                return result
            if output.new_token_ids:
                now = time.perf_counter()
                if result.output_tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
                result.output_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                break
    except TimeoutError:
        await client.abort([request_id])
        result.error = f"no output for {args.timeout} s"
        return result
    finally:
        client.release(request_id)
    result.e2e_s = time.perf_counter() - start
    result.ok = True
    return result


async def run_engine(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[list[Result], float, dict[str, Any]]:
    input_address, output_address = engine_addresses(args.address)
    client = AsyncEngineClient(input_address, output_address, client_id=f"bench-{uuid.uuid4().hex[:8]}")
    try:
        info = await client.register(timeout_s=args.connect_timeout)
        results, duration = await drive(args, requests, lambda request: send_tokens(client, args, request))
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


def cmd_bench_engine(args: argparse.Namespace) -> int:
    args.endpoint = "completions"  # token-id prompts
    requests = random_requests(args, random.Random(args.seed))
    results, duration, info = uvloop.run(run_engine(args, requests))
    summary = summarize(args, results, duration, args.address)
    summary["model"] = info
    print(f"engine at {args.address} (ZMQ, token ids; no HTTP, no tokenizer)")
    print(table(summary))
    report: dict[str, Any] = {"summary": summary, "requests": [asdict(r) for r in results]}
    failed = summary["failed"]
    if args.compare_base_url:
        args.base_url = args.compare_base_url
        args.model = args.served_model_name or first_model(args.base_url, args.api_key)
        # Fresh prompts of the same shapes: the engine's prefix cache must not favour the second pass.
        again = random_requests(args, random.Random(args.seed + 7919))
        serve_results, serve_duration = uvloop.run(run(args, again))
        serve_summary = summarize(args, serve_results, serve_duration, args.base_url)
        cost = frontend_cost(summary, serve_summary)
        print(f"\nthe same requests through {args.base_url} (HTTP, SSE)")
        print(table(serve_summary))
        print("\nfrontend cost (HTTP minus ZMQ, same load)")
        print(
            f"{'TTFT mean / p99 (ms):':<36}{1000 * cost['ttft_mean_s']:+.1f} / {1000 * cost['ttft_p99_s']:+.1f}"
        )
        print(f"{'ITL mean (ms):':<36}{1000 * cost['itl_mean_s']:+.2f}")
        print(f"{'E2E mean (ms):':<36}{1000 * cost['e2el_mean_s']:+.1f}")
        print(f"{'Output throughput, HTTP / ZMQ:':<36}{cost['output_throughput_ratio']:.3f}")
        report.update(serve_summary=serve_summary, frontend_cost=cost)
        failed += serve_summary["failed"]
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
    add_workload_args(engine, ("random", "shared-prefix"))
    engine.set_defaults(func=cmd_bench_engine)
