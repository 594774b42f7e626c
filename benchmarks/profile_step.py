"""Where a decode step's time goes: the engine in-process (no HTTP, no worker process), one batch.

    python -m benchmarks.profile_step [--batch 16] [--dtype bfloat16] [--steps 40]

Prints the wall-clock time per decode step and torch profiler's table of the top ops over 20 steps.
Prompts are 100 random tokens, greedy, ignore_eos. The figures and their reading:
benchmarks/results/2026-11-29-lab-notes-performance.md, "Decode step, in-process".
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.inprocess import inprocess_engine
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    core = inprocess_engine(args.model, args.dtype, num_kv_blocks=1024)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 200, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 20000) for _ in range(100)]
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=0)
        )
    for _ in range(12):  # prefill, then warm decode steps
        core.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    per_step = (time.perf_counter() - start) / args.steps
    print(
        f"batch {args.batch}, {args.dtype}: {1000 * per_step:.1f} ms per decode step ({torch.get_num_threads()} threads)"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            core.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40))
    core.shutdown()


if __name__ == "__main__":
    main()
