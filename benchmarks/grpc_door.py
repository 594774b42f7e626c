"""The gRPC front door's cost against HTTP's, on one engine (docs/grpc.md): `engine serve` (HTTP, its
engine on a tcp address) and `engine serve --attach ADDR --grpc` beside it, the same token-id requests
at concurrency C through each: POST /inference/v1/generate (JSON, streamed as SSE) and VllmEngine.Generate
(protobuf, streamed chunks). Each round runs HTTP then gRPC then HTTP again (the mean of the two HTTP
runs is the baseline, so the engine's drift between runs cancels); prints requests/s, TTFT and ITL
percentiles, and gRPC's ratios to HTTP.

    python -m benchmarks.grpc_door [--model MODEL] [--concurrency 64] [--requests 256] [--output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import httpx

from frontend.grpc_door import vllm_engine_pb2 as pb
from frontend.grpc_door import vllm_engine_pb2_grpc as pb_grpc
from tests.serve_helpers import free_engine_port, free_port, stop, wait_healthy, wait_until


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.requests)]


async def run_http(base: str, ids: list[list[int]], args: argparse.Namespace) -> list[list[float]]:
    """Each request's token arrival times, from its send."""
    limit = asyncio.Semaphore(args.concurrency)
    params = {"temperature": 0, "max_tokens": args.output_len, "ignore_eos": True}
    async with httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=args.concurrency)
    ) as client:

        async def one(prompt: list[int]) -> list[float]:
            async with limit:
                start, times = time.perf_counter(), []
                body = {"token_ids": prompt, "sampling_params": params, "stream": True}
                async with client.stream("POST", f"{base}/inference/v1/generate", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for choice in json.loads(line[6:])["choices"]:
                                times += [time.perf_counter() - start] * len(choice["token_ids"])
                return times

        return list(await asyncio.gather(*(one(p) for p in ids)))


async def run_grpc(target: str, ids: list[list[int]], args: argparse.Namespace) -> list[list[float]]:
    limit = asyncio.Semaphore(args.concurrency)
    params = pb.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.VllmEngineStub(channel)

        async def one(prompt: list[int]) -> list[float]:
            async with limit:
                start, times = time.perf_counter(), []
                request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=params,
                                             stream=True)  # fmt: skip
                async for answer in stub.Generate(request):
                    if answer.WhichOneof("response") == "chunk":
                        times += [time.perf_counter() - start] * len(answer.chunk.token_ids)
                return times

        return list(await asyncio.gather(*(one(p) for p in ids)))


def summary(runs: list[list[float]], wall_s: float) -> dict[str, float]:
    ttft = sorted(times[0] for times in runs)
    gaps = sorted(b - a for times in runs for a, b in zip(times, times[1:], strict=False))

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    return {"req_per_s": len(runs) / wall_s, "tok_per_s": sum(len(t) for t in runs) / wall_s,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99), "itl_p50_ms": pct(gaps, 0.5),
            "itl_p99_ms": pct(gaps, 0.99)}  # fmt: skip


async def timed(work: Any) -> dict[str, float]:
    start = time.perf_counter()
    runs = await work
    return summary(runs, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model is None:
        from tests.conftest import smollm2_path

        args.model = smollm2_path()
    engine = f"tcp://127.0.0.1:{free_engine_port()}"
    http_port, grpc_port = free_port(), free_port()
    cli = [sys.executable, "-m", "frontend.cli", "serve"]
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    http = subprocess.Popen([*cli, args.model, "--port", str(http_port), "--engine-address", engine,
                             "--max-num-seqs", str(args.concurrency)], **quiet)  # fmt: skip
    processes = [http]
    try:
        base, target = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        wait_healthy(http, base, 300)
        processes.append(
            subprocess.Popen([*cli, "--attach", engine, "--grpc", "--port", str(grpc_port)], **quiet)
        )
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200 and _grpc_up(target), 120, "gRPC")
        ids = prompts(args)
        asyncio.run(timed(run_http(base, ids[: args.concurrency], args)))  # warm both paths
        asyncio.run(timed(run_grpc(target, ids[: args.concurrency], args)))
        for round_index in range(args.rounds):
            first = asyncio.run(timed(run_http(base, ids, args)))
            over_grpc = asyncio.run(timed(run_grpc(target, ids, args)))
            second = asyncio.run(timed(run_http(base, ids, args)))
            over_http = {key: (first[key] + second[key]) / 2 for key in first}
            print(f"round {round_index + 1}: c={args.concurrency}, {args.requests} requests of {args.input_len} "
                  f"-> {args.output_len} tokens")  # fmt: skip
            for name, numbers in (("HTTP", over_http), ("gRPC", over_grpc)):
                print(f"  {name:5s} " + "  ".join(f"{key} {value:8.1f}" for key, value in numbers.items()))
            ratios = {key: over_grpc[key] / over_http[key] for key in over_http}
            print("  gRPC/HTTP " + "  ".join(f"{key} {value:.3f}x" for key, value in ratios.items()))
            spread = statistics.pstdev([first["req_per_s"], second["req_per_s"]]) / over_http["req_per_s"]
            print(f"  (HTTP's two runs differ by {spread * 200:.1f}% in req/s)")
    finally:
        for process in reversed(processes):
            stop(process)


def _grpc_up(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.VllmEngineStub(channel)
            return bool(stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy)
    except grpc.RpcError:
        return False


if __name__ == "__main__":
    main()
