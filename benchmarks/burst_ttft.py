"""TTFT of a burst of prompts against the step token budget: the engine in-process, one engine per
budget, bursts alternating between them so a noisy machine slows them alike.

    python -m benchmarks.burst_ttft [--burst 16] [--budgets 2048 512 256] [--rounds 3]

Each round sends every engine a burst of `--burst` random 100-token prompts (greedy, 128 tokens out,
ignore_eos) and runs it to the end; it prints, per budget and round, the burst's median time to first
token and its output tokens/s. The reading: benchmarks/results/2026-11-29-lab-notes-performance.md, "Where a
step goes now".
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.inprocess import inprocess_engine
from engine_core.engine_core import EngineCore
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams


def run_burst(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str
) -> tuple[float, float]:
    """(median seconds to first token, output tokens/s) of one burst run to completion."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(
            AddRequest(
                request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params, arrival_time=0
            )
        )
    first: dict[str, float] = {}
    tokens = 0
    while core.has_unfinished_requests():
        for request, output in core.step():
            if output.new_token_ids and request.request_id not in first:
                first[request.request_id] = time.perf_counter() - start
            tokens += len(output.new_token_ids)
    return statistics.median(first.values()), tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 512, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    cores = {
        budget: inprocess_engine(args.model, args.dtype, num_kv_blocks=2048, max_num_batched_tokens=budget)
        for budget in args.budgets
    }
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    results: dict[int, list[tuple[float, float]]] = {budget: [] for budget in args.budgets}
    for round_index in range(args.rounds):
        for budget, core in cores.items():
            prompts = [[rng.randrange(1000, 20000) for _ in range(100)] for _ in range(args.burst)]
            results[budget].append(run_burst(core, prompts, params, f"{round_index}"))
    for budget, runs in results.items():
        ttft = " ".join(f"{1000 * r[0]:.0f}" for r in runs)
        speed = " ".join(f"{r[1]:.0f}" for r in runs)
        print(f"budget {budget}: burst of {args.burst}, TTFT p50 ms {ttft}; output tok/s {speed}")
    for core in cores.values():
        core.shutdown()


if __name__ == "__main__":
    main()
