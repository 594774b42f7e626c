"""`engine bench serve --endpoint embeddings`: inputs through POST /v1/embeddings at a fixed concurrency,
`--inputs-per-request` a request (the way RAG stacks send chunks); inputs/s, requests/s, latency.

Inputs are random words of about `--input-len` tokens each (± `--range-ratio`): a common English word is
one wordpiece. `texts(args, seed)` gives the same inputs to an in-process baseline (benchmarks/
embeddings_throughput.py runs SentenceTransformer.encode on them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from frontend.bench.common import WORDS, percentiles


def texts(args: argparse.Namespace, seed: int) -> list[str]:
    rng = random.Random(seed)
    low = max(1, int(args.input_len * (1 - args.range_ratio)))
    high = max(low, int(args.input_len * (1 + args.range_ratio)))
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(args.num_prompts)
    ]


async def _run(args: argparse.Namespace, inputs: list[str]) -> dict[str, Any]:
    import aiohttp

    per = args.inputs_per_request
    batches = [inputs[i : i + per] for i in range(0, len(inputs), per)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(args.max_concurrency or 16)
    latencies: list[float] = []
    errors: list[str] = []
    tokens = completed = 0

    async def one(client: Any, batch: list[str]) -> None:
        nonlocal tokens, completed
        async with semaphore:
            start = time.perf_counter()
            body = {"model": args.model, "input": batch, **(args.extra_body or {})}
            async with client.post("v1/embeddings", json=body) as response:
                answer = await response.read()
            if response.status != 200:
                errors.append(f"HTTP {response.status}: {answer[:200]!r}")
                return
            latencies.append(time.perf_counter() - start)
            tokens += json.loads(answer)["usage"]["prompt_tokens"]
            completed += len(batch)

    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 16)
    async with aiohttp.ClientSession(
        args.base_url.rstrip("/") + "/", headers=headers, connector=connector
    ) as client:
        for batch in batches[: args.warmup]:
            await one(client, batch[::-1])
        latencies.clear()
        tokens = completed = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, batch) for batch in batches))
        duration = time.perf_counter() - start
    return {
        "endpoint": "embeddings",
        "target": args.base_url,
        "inputs": len(inputs),
        "inputs_per_request": per,
        "max_concurrency": args.max_concurrency or 16,
        "duration_s": duration,
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "input_throughput": completed / duration if duration else 0.0,
        "request_throughput": len(latencies) / duration if duration else 0.0,
        "token_throughput": tokens / duration if duration else 0.0,
        "latency_s": percentiles(latencies),
    }


def table(summary: dict[str, Any]) -> str:
    latency = summary["latency_s"]
    return "\n".join(
        [
            f"{'Inputs (per request):':<36}{summary['inputs']} ({summary['inputs_per_request']})",
            f"{'Failed requests:':<36}{summary['failed']}",
            f"{'Benchmark duration (s):':<36}{summary['duration_s']:.2f}",
            f"{'Input throughput (inputs/s):':<36}{summary['input_throughput']:.2f}",
            f"{'Request throughput (req/s):':<36}{summary['request_throughput']:.2f}",
            f"{'Token throughput (tok/s):':<36}{summary['token_throughput']:.2f}",
            f"{'Latency (ms) mean/p50/p90/p99:':<36}"
            + " / ".join(f"{1000 * latency[q]:.1f}" for q in ("mean", "p50", "p90", "p99")),
        ]
    )


def cmd_bench_embeddings(args: argparse.Namespace) -> int:
    summary = asyncio.run(_run(args, texts(args, args.seed)))
    print(table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": summary}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
