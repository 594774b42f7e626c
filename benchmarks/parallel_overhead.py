"""What tensor parallel adds to a decode step on this CPU: TP=2 over gloo on loopback, per row count.

    python -m benchmarks.parallel_overhead [--rows 1,64] [--iterations 1000]

Two ranks, two subprocesses (one torch thread each, gloo on `lo`, joined by TensorParallelGroup), time for
a decode step of ROWS running requests, in µs (median / p90):
- relay: the step's SchedulerOutput (ROWS cached requests of one token, a new block id when one starts a
  block), encoded once as the engine does, rank 0 -> rank 1 through worker/parallel/relay.py's Relay
  (ROUTER -> DEALER, tcp on 127.0.0.1), decoded there. One way by timestamps (CLOCK_MONOTONIC, shared by
  both processes) from rank 0's send to the end of rank 1's decode, paced by a ping-pong whose round trip
  / 2 is shown beside it.
- all-reduce of a [ROWS, 576] float32 and bfloat16 activation, plain (dist.all_reduce) and batch-invariant
  (TensorParallelGroup.all_reduce: all_gather, then a sum in rank order); 61 a step (2 x 30 layers, and
  the vocab-parallel embedding).
- gather_logits of [ROWS, 49152 / 2] float32 to rank 0; broadcast_token_ids of [ROWS] int64.
Per step = relay one way + 61 x all-reduce + gather + broadcast (medians), for each all-reduce variant,
and its ratio to a TP=1 decode step that rank 0 times alone in the same run: a STAND-IN, torch F.linear of
SmolLM2-135M's shapes (30 layers of q/k/v, o, gate_up and down; the lm_head), float32, one thread, no
attention. A ratio of 0.10: the communication alone costs a tenth of a TP=1 step; TP=2 can at best halve
the compute, so it pays only well under 0.5. Both ranks share this machine's cores. Rank 0 prints the
table and writes benchmarks/results/parallel_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from protocol.codec import worker_input_codec
from protocol.config import DEFAULT_BLOCK_SIZE, ParallelConfig
from protocol.worker_messages import CachedRequestData, SchedulerOutput, WorkerCallResult
from worker.parallel.group import TensorParallelGroup
from worker.parallel.relay import Relay

HIDDEN, INTERMEDIATE, QKV, VOCAB, NUM_LAYERS = 576, 1536, 576 + 2 * 192, 49152, 30  # SmolLM2-135M
NUM_ALL_REDUCES = 2 * NUM_LAYERS + 1  # o_proj and down_proj in each layer, and the embedding
TP_SIZE = 2
TIMEOUT_S = 120.0
DEFAULT_VARIANT = "batch-invariant bfloat16"  # SmolLM2's dtype; batch invariance is on with the csrc kernels
FIXED_COSTS = ("relay_one_way_us", "gather_logits_us", "broadcast_token_ids_us")  # once a step
Stats = dict[str, float]


def summary(samples: list[float]) -> Stats:
    return {"median": statistics.median(samples), "p90": statistics.quantiles(samples, n=10)[-1]}


def num_warmup(iterations: int) -> int:
    return max(5, iterations // 10)


def decode_steps(num_requests: int) -> list[SchedulerOutput]:
    """A block's worth of consecutive decode steps of num_requests running requests, as the scheduler
    sends them: every request a CachedRequestData, the ones whose next token starts a block with its id."""
    rng = random.Random(num_requests)
    request_ids = [f"cmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}" for _ in range(num_requests)]
    num_computed = [rng.randrange(100, 1000) for _ in request_ids]
    steps = []
    for step in range(DEFAULT_BLOCK_SIZE):
        cached = []
        for request_id, computed in zip(request_ids, num_computed, strict=True):
            new_block_ids = [rng.randrange(32768)] if (computed + step) % DEFAULT_BLOCK_SIZE == 0 else []
            cached.append(CachedRequestData(request_id, new_block_ids, computed + step))
        steps.append(
            SchedulerOutput(
                new_requests=[],
                cached_requests=cached,
                num_scheduled_tokens=dict.fromkeys(request_ids, 1),
                total_num_scheduled_tokens=num_requests,
                finished_request_ids=[],
            )
        )
    return steps


def time_relay(relay: Relay, rank: int, rows: int, iterations: int) -> dict[str, Any]:
    """Rank 0 sends one step's frames and waits for rank 1's timestamps: when it received, when it decoded."""
    codec = worker_input_codec()
    num_messages = num_warmup(iterations) + iterations
    if rank != 0:
        for _ in range(num_messages):
            frames = relay.receive(int(TIMEOUT_S * 1000))
            if frames is None:
                raise RuntimeError("rank 0 sent nothing in time")
            received_ns = time.monotonic_ns()
            codec.decode(frames)
            relay.answer(WorkerCallResult(result=[received_ns, time.monotonic_ns()]))
        return {}
    messages = [codec.encode(step) for step in decode_steps(rows)]  # once, as the engine encodes
    samples_ns: list[tuple[int, int, int, int]] = []  # sent, received, decoded, answer back
    for i in range(num_messages):
        sent_ns = time.monotonic_ns()
        relay.forward(messages[i % len(messages)])
        (answer,) = relay.gather_answers()
        samples_ns.append((sent_ns, *answer.result, time.monotonic_ns()))
    timed = samples_ns[-iterations:]
    return {
        "message_bytes": round(statistics.mean(sum(map(len, frames)) for frames in messages)),
        "relay_one_way_us": summary([(decoded - sent) / 1e3 for sent, _, decoded, _ in timed]),
        "relay_decode_us": summary([(decoded - received) / 1e3 for _, received, decoded, _ in timed]),
        "relay_half_round_trip_us": summary([(back - sent) / 2e3 for sent, _, _, back in timed]),
    }


def time_calls(iterations: int, call: Callable[..., object], *args: Any) -> Stats:
    """Per call, in µs; both ranks run the same loop, so rank 0's figure includes waiting for rank 1."""
    for _ in range(num_warmup(iterations)):
        call(*args)
    samples = []
    for _ in range(iterations):
        begin = time.perf_counter()
        call(*args)
        samples.append((time.perf_counter() - begin) * 1e6)
    return summary(samples)


def time_collectives(group: TensorParallelGroup, rows: int, iterations: int) -> dict[str, Any]:
    assert group.batch_invariant  # the plain variant calls dist.all_reduce itself
    all_reduce_us = {}
    for dtype in (torch.float32, torch.bfloat16):
        # NOTE: zeros, as the sums are done in place: ones would double each call, reach inf, and time that
        x = torch.zeros(rows, HIDDEN, dtype=dtype)  # [rows, hidden]
        name = str(dtype).removeprefix("torch.")
        all_reduce_us[name] = time_calls(iterations, dist.all_reduce, x)
        all_reduce_us[f"batch-invariant {name}"] = time_calls(iterations, group.all_reduce, x)
    logits = torch.zeros(rows, VOCAB // TP_SIZE)  # [rows, vocab / tp] float32, this rank's shard
    token_ids = torch.zeros(rows, dtype=torch.int64)  # [rows]
    return {
        "all_reduce_us": all_reduce_us,
        "gather_logits_us": time_calls(iterations, group.gather_logits, logits, VOCAB),
        "broadcast_token_ids_us": time_calls(iterations, group.broadcast_token_ids, token_ids),
    }


def time_stand_in_step(rows_list: list[int], iterations: int) -> dict[int, Stats]:
    """A TP=1 decode step's products of SmolLM2-135M's shapes (540 MB of float32 weights, read once a step)."""
    seeded = torch.Generator().manual_seed(0)
    # [out, in] of q/k/v, o, gate_up and down
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    layers = [[torch.randn(*shape, generator=seeded) * 0.02 for shape in shapes] for _ in range(NUM_LAYERS)]
    lm_head = torch.randn(VOCAB, HIDDEN, generator=seeded) * 0.02

    def step(x: torch.Tensor) -> torch.Tensor:
        for qkv, o, gate_up, down in layers:
            F.linear(x, qkv)  # [rows, q + 2 * kv]
            x = x + F.linear(x, o)  # [rows, hidden]
            hidden = F.linear(x, gate_up)[:, :INTERMEDIATE]  # [rows, intermediate]: silu-and-mul left out
            x = x + F.linear(hidden, down)  # [rows, hidden]
        return F.linear(x, lm_head)  # [rows, vocab]

    with torch.inference_mode():
        return {
            rows: time_calls(max(3, iterations // 100), step, torch.randn(rows, HIDDEN, generator=seeded))
            for rows in rows_list
        }


def per_step(measured: dict[str, Any], baseline: Stats) -> None:
    """Adds each all-reduce variant's per-step total and its ratio to the stand-in TP=1 step."""
    fixed = sum(measured[key]["median"] for key in FIXED_COSTS)
    totals = {name: fixed + NUM_ALL_REDUCES * s["median"] for name, s in measured["all_reduce_us"].items()}
    ratios = {name: total / baseline["median"] for name, total in totals.items()}
    measured.update(per_step_us=totals, stand_in_tp1_step_us=baseline, ratio_to_tp1_step=ratios)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def report(args: argparse.Namespace, results: dict[int, dict[str, Any]]) -> None:
    columns = list(results.values())
    variants = list(columns[0]["all_reduce_us"])

    def stats_row(label: str, key: str, name: str | None = None) -> tuple[str, list[str]]:
        cells = [r[key] if name is None else r[key][name] for r in columns]
        return label, [f"{stats['median']:.0f} / {stats['p90']:.0f}" for stats in cells]

    def step_row(name: str) -> tuple[str, list[str]]:
        cells = [f"{r['per_step_us'][name]:.0f} = {r['ratio_to_tp1_step'][name]:.3f}x" for r in columns]
        return f"per step, {NUM_ALL_REDUCES} x {name} (x TP=1 step)", cells

    lines = [
        ("SchedulerOutput, bytes", [str(r["message_bytes"]) for r in columns]),
        stats_row("relay one way, send -> decoded (timestamps)", "relay_one_way_us"),
        stats_row("  of which rank 1's decode", "relay_decode_us"),
        stats_row("relay round trip / 2 (ping-pong)", "relay_half_round_trip_us"),
        *(stats_row(f"all-reduce [rows, {HIDDEN}] {name}", "all_reduce_us", name) for name in variants),
        stats_row(f"gather logits [rows, {VOCAB // TP_SIZE}] float32", "gather_logits_us"),
        stats_row("broadcast sampled ids [rows] int64", "broadcast_token_ids_us"),
        *(step_row(name) for name in variants),
        stats_row("TP=1 decode step: the F.linear stand-in", "stand_in_tp1_step_us"),
    ]
    print(f"tensor parallel overhead, TP=2 over gloo on loopback, 1 thread a rank: {cpu_name()}, "
          f"torch {torch.__version__}, {args.iterations} iterations")  # fmt: skip
    width = max(len(label) for label, _ in lines) + 2
    print("µs, median / p90".ljust(width) + "".join(f"{f'c={rows}':>22}" for rows in results))
    for label, values in lines:
        print(label.ljust(width) + "".join(f"{value:>22}" for value in values))
    overheads = [
        f"c={rows} {r['per_step_us'][DEFAULT_VARIANT] / 1e3:.2f} ms ({r['ratio_to_tp1_step'][DEFAULT_VARIANT]:.3f}x)"
        for rows, r in results.items()
    ]
    print(
        f"per-step overhead, {DEFAULT_VARIANT} all-reduces, x the stand-in TP=1 step: {', '.join(overheads)}"
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {"cpu": cpu_name(), "torch": torch.__version__, "iterations": args.iterations,
                "tensor_parallel_size": TP_SIZE, "rows": {str(rows): r for rows, r in results.items()}}  # fmt: skip
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {output}")


def run_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    config = ParallelConfig(
        tensor_parallel_size=TP_SIZE, master_addr="127.0.0.1", master_port=args.port, timeout_s=TIMEOUT_S
    )
    group = TensorParallelGroup(config, args.rank, batch_invariant=True)
    relay = Relay(group.store, args.rank, TP_SIZE, "127.0.0.1", TIMEOUT_S)
    results: dict[int, dict[str, Any]] = {}
    try:
        for rows in args.rows:
            results[rows] = time_relay(relay, args.rank, rows, args.iterations)
            results[rows].update(time_collectives(group, rows, args.iterations))
    finally:
        relay.close()
        group.destroy()
    if args.rank == 0:
        baseline = time_stand_in_step(args.rows, args.iterations)  # the other rank has exited: rank 0 alone
        for rows, measured in results.items():
            per_step(measured, baseline[rows])
        report(args, results)


def launch(args: argparse.Namespace) -> int:
    """Starts both ranks; a rank that fails takes the other down rather than leaving it in a collective."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "benchmarks.parallel_overhead", "--port", str(port),
               "--rows", ",".join(map(str, args.rows)), "--iterations", str(args.iterations), "--output", args.output]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [subprocess.Popen([*command, "--rank", str(rank)], env=env) for rank in range(TP_SIZE)]
    try:
        while None in (codes := [process.poll() for process in ranks]) and not any(codes):
            time.sleep(0.1)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    return max(abs(process.wait()) for process in ranks)


def parse_rows(text: str) -> list[int]:
    if not all(part.isdigit() and int(part) > 0 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"--rows takes positive integers separated by commas, got {text!r}")
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=parse_rows, default=[1, 64], help="row counts (decode concurrency)")
    parser.add_argument("--iterations", type=int, default=1000, help="timed calls of each collective")
    parser.add_argument("--output", default="benchmarks/results/parallel_overhead.json")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # set by launch()
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (a p90 needs two samples)")
    if args.rank is None:
        return launch(args)
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
