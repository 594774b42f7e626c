"""`engine bench serve`: load any OpenAI-compatible server (ours, vLLM, llama.cpp) and report latency
and throughput: requests/s, output and total tokens/s, TTFT, TPOT, ITL and E2E (mean, p50, p90, p99),
goodput against SLOs, failures. Streaming requests to /v1/completions, /v1/chat/completions or
/v1/responses (or, `--endpoint embeddings`, inputs to /v1/embeddings: frontend/bench/embeddings.py);
random, ShareGPT or shared-prefix prompts; a Poisson request rate (with burstiness) or a
fixed concurrency. `--endpoint responses --responses-store both` measures what storing a response costs
(frontend/bench/responses_store.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import uvloop

from frontend.bench.common import WORDS, percentiles


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str | None = None  # a LoRA adapter's name (--lora-modules); None: --model


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""


def random_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    def length(mean: int) -> int:
        low = max(1, int(mean * (1 - args.range_ratio)))
        return rng.randint(low, max(low, int(mean * (1 + args.range_ratio))))

    requests = []
    shared = args.prefix_len if args.dataset == "shared-prefix" else 0
    prefix_ids = [rng.randrange(1000, 20000) for _ in range(shared)]
    prefix_text = " ".join(rng.choice(WORDS) for _ in range(shared))
    for _ in range(args.num_prompts):
        n = length(args.input_len)
        if args.endpoint in ("chat", "responses"):  # text; a word is about one token
            text = " ".join([prefix_text, *(rng.choice(WORDS) for _ in range(n))]).strip()
            requests.append(BenchRequest(text, shared + n, length(args.output_len)))
        else:  # token ids: exact lengths, no tokenizer needed
            ids = prefix_ids + [rng.randrange(1000, 20000) for _ in range(n)]
            requests.append(BenchRequest(ids, len(ids), length(args.output_len)))
    return requests


def sharegpt_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    with open(args.dataset_path) as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    rng.shuffle(pairs)
    return [
        BenchRequest(prompt, max(1, len(prompt.split())), args.output_len or max(1, len(answer.split())))
        for prompt, answer in pairs[: args.num_prompts]
    ]


def request_body(args: argparse.Namespace, request: BenchRequest) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed request to the endpoint under test."""
    body: dict[str, Any] = {"model": request.model or args.model, "stream": True, "temperature": 0.0}
    if args.endpoint == "responses":
        # NOTE: no stream_options (the Responses door refuses it): its last event carries the usage.
        body.update(input=request.prompt, max_output_tokens=request.output_len, store=args.responses_store)
    else:
        body.update(max_tokens=request.output_len, stream_options={"include_usage": True})
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(getattr(args, "extra_body", None) or {})  # e.g. a response_format (bench serve only)
    if args.endpoint == "responses":
        return "v1/responses", body
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
        return "v1/chat/completions", body
    body["prompt"] = request.prompt
    return "v1/completions", body


def event_text(event: dict[str, Any], result: Result) -> str | None:
    """The text one streamed event adds; a usage event sets result.output_tokens, an error result.error."""
    kind = event.get("type")
    if kind is not None and kind.startswith(("response.", "error")):  # a Responses event
        if kind == "response.output_text.delta":
            return str(event["delta"])
        if kind in ("response.completed", "response.incomplete"):
            result.output_tokens = (event["response"].get("usage") or {}).get("output_tokens", 0)
        elif kind in ("response.failed", "error"):
            error = event.get("response", {}).get("error") if kind == "response.failed" else event
            result.error = str((error or {}).get("message") or kind)
        return None
    if "error" in event:
        result.error = str(event["error"].get("message"))
        return None
    if event.get("usage") and not event.get("choices"):
        result.output_tokens = event["usage"].get("completion_tokens", 0)
        return None
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")


async def send(client: Any, args: argparse.Namespace, request: BenchRequest) -> Result:
    path, body = request_body(args, request)
    result = Result(ok=False, prompt_len=request.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.post(path, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                text = event_text(json.loads(line[6:]), result)
                if result.error:
                    return result
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
                chunks += 1
    except Exception as error:  # a benchmark records failures, it does not stop on them
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def warmup_variant(request: BenchRequest) -> BenchRequest:
    """A request of the same shape with another prompt, so warm-up fills no prefix cache for the run."""
    if isinstance(request.prompt, list):
        prompt: str | list[int] = request.prompt[::-1]
    else:
        prompt = " ".join(request.prompt.split()[::-1])
    return BenchRequest(prompt, request.prompt_len, request.output_len)


async def drive(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    send_one: Callable[[BenchRequest], Awaitable[Result]],
) -> tuple[list[Result], float]:
    """Warm up, then send every request at the given rate or concurrency; (results, seconds)."""
    for request in requests[: args.warmup]:
        await send_one(warmup_variant(request))
    semaphore = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    rng = random.Random(args.seed + 1)
    progress = _progress(len(requests), args.quiet)

    async def one(request: BenchRequest) -> Result:
        async with semaphore:
            result = await send_one(request)
        progress.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if args.request_rate != float("inf"):
            # Gamma inter-arrival times: burstiness 1 is Poisson, lower is burstier.
            theta = 1.0 / (args.request_rate * args.burstiness)
            await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


async def run(args: argparse.Namespace, requests: list[BenchRequest]) -> tuple[list[Result], float]:
    # aiohttp (C HTTP parser) rather than httpx: the client shares the machine with the server it
    # measures, and httpx's pure-Python HTTP/1.1 path cost three times the CPU per streamed token.
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # NOTE: no keep-alive: some servers (llama.cpp's) close a kept-alive connection after a few
    # requests, racing the client's next request on it; a loopback connect costs well under a ms.
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 1000, force_close=True)
    async with aiohttp.ClientSession(
        args.base_url.rstrip("/") + "/",
        headers=headers,
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=args.timeout),
        read_bufsize=1 << 20,  # an SSE line (with logprobs) may be long
    ) as client:
        return await drive(args, requests, lambda request: send(client, args, request))


def _progress(total: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", disable=quiet)


def summarize(
    args: argparse.Namespace, results: list[Result], duration: float, target: str
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    slo = {k: float(v) / 1000 for k, v in (item.split(":") for item in args.goodput or [])}
    good = [
        r
        for r in done
        if r.ttft_s <= slo.get("ttft", float("inf"))
        and (
            r.output_tokens <= 1
            or (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) <= slo.get("tpot", float("inf"))
        )
        and r.e2e_s <= slo.get("e2el", float("inf"))
    ]
    return {
        "target": target,
        "endpoint": getattr(args, "endpoint", "engine"),
        "store": args.responses_store if getattr(args, "endpoint", "") == "responses" else None,
        "dataset": args.dataset,
        "num_prompts": len(results),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "goodput": len(good) / duration if duration and slo else None,
        "ttft_s": percentiles([r.ttft_s for r in done]),
        "tpot_s": percentiles(tpots),
        "itl_s": percentiles([x for r in done for x in r.itls_s]),
        "e2el_s": percentiles([r.e2e_s for r in done]),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
    }


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'Successful requests:':<36}{summary['completed']}",
        f"{'Failed requests:':<36}{summary['failed']}",
        f"{'Benchmark duration (s):':<36}{summary['duration_s']:.2f}",
        f"{'Request throughput (req/s):':<36}{summary['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<36}{summary['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<36}{summary['total_token_throughput']:.2f}",
    ]
    if summary["goodput"] is not None:
        lines.append(f"{'Goodput (req/s):':<36}{summary['goodput']:.2f}")
    for key, title in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2E")):
        stats = summary[key]
        lines.append(
            f"{title + ' (ms) mean/p50/p90/p99:':<36}"
            + " / ".join(f"{1000 * stats[q]:.1f}" for q in ("mean", "p50", "p90", "p99"))
        )
    return "\n".join(lines)


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model a server lists: what to ask for when the user named none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return str(httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers).json()["data"][0]["id"])


def bench_requests(args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = sharegpt_requests(args, rng) if args.dataset == "sharegpt" else random_requests(args, rng)
    for request in requests if getattr(args, "lora_modules", None) else []:
        request.model = rng.choice(args.lora_modules)  # vLLM's bench serve: an adapter per request
    return requests


def one_pass(args: argparse.Namespace, seed: int) -> tuple[dict[str, Any], list[Result]]:
    """The load once, its prompts drawn from seed: the summary and every request's result."""
    results, duration = uvloop.run(run(args, bench_requests(args, seed)))
    return summarize(args, results, duration, args.base_url), results


def cmd_bench_serve(args: argparse.Namespace) -> int:
    both = args.responses_store == "both"
    if args.responses_store != "true" and args.endpoint != "responses":
        raise SystemExit("--responses-store is for --endpoint responses")
    if args.rounds < 1 or (args.rounds > 1 and not (both or args.lora_compare)):
        raise SystemExit(
            "--rounds takes a count >= 1, and more than one round needs --responses-store both or --lora-compare"
        )
    if args.lora_compare and not args.lora_modules:
        raise SystemExit("--lora-compare needs --lora-modules")
    args.model = args.model or first_model(args.base_url, args.api_key)
    if args.endpoint == "embeddings":
        from frontend.bench.embeddings import cmd_bench_embeddings

        return cmd_bench_embeddings(args)
    if both:
        from frontend.bench.responses_store import compare_store

        return compare_store(args, one_pass, table)
    if args.lora_compare:
        from frontend.bench.lora import compare_lora

        return compare_lora(args, one_pass, table)
    args.responses_store = args.responses_store == "true"
    summary, results = one_pass(args, args.seed)
    print(table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def add_workload_args(parser: argparse.ArgumentParser, datasets: tuple[str, ...]) -> None:
    """The load shared by `bench serve` and `bench engine`: what is sent, and how fast."""
    parser.add_argument("--dataset", choices=datasets, default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn in mean*(1±ratio)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix dataset: tokens shared")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals; <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first")
    parser.add_argument(
        "--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (change it to defeat prefix caches)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_serve_bench_parser(kinds: Any) -> None:
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server and report latency/throughput")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument(
        "--endpoint", choices=["completions", "chat", "responses", "embeddings"], default="completions"
    )
    serve.add_argument(
        "--inputs-per-request", type=int, default=16, help="--endpoint embeddings: inputs in one request"
    )
    serve.add_argument(
        "--responses-store",
        choices=["true", "false", "both"],
        default="true",
        help="--endpoint responses: the requests' store field; both: the two, same load, and their ratio",
    )
    serve.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --responses-store both: this many pairs of passes, taking turns; the medians are reported",
    )
    serve.add_argument("--model", default=None, help="default: the server's first model")
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapter names the server has: each request names one at random as its model",
    )
    serve.add_argument(
        "--lora-compare",
        action="store_true",
        help="with --lora-modules: the same load on the base model too, and the throughput ratio (--rounds)",
    )
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset-path", default=None, help="a ShareGPT-format JSON file")
    serve.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        help="JSON merged into each request, e.g. '{\"response_format\": ...}'",
    )
    add_workload_args(serve, ("random", "sharegpt", "shared-prefix"))
    serve.set_defaults(func=cmd_bench_serve)
