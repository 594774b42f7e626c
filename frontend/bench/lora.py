"""`engine bench serve --lora-modules A B ... --lora-compare`: what serving adapters costs at the same load.

With --lora-modules each request names one of the adapters at random as its `model` (vLLM's bench
serve does the same). --lora-compare runs the load twice a round, once on the base model and once
spread over the adapters, each pass with fresh prompts of the same shapes (so the prefix cache favours
neither), the two taking turns going first; it prints each round's output-throughput ratio (adapters
over base) and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

from frontend.bench.common import alternating_rounds
from frontend.bench.responses_store import Measure


def lora_pass(args: argparse.Namespace, measure: Measure, adapters: bool, seed: int) -> dict[str, Any]:
    modules = args.lora_modules if adapters else None
    summary, _ = measure(argparse.Namespace(**{**vars(args), "lora_modules": modules}), seed)
    return summary


def compare_lora(args: argparse.Namespace, measure: Measure, table: Callable[[dict[str, Any]], str]) -> int:
    rounds = alternating_rounds(
        args.rounds, args.seed, False, lambda on, seed: lora_pass(args, measure, on, seed)
    )

    def ratio(passes: dict[bool, dict[str, Any]], name: str) -> float:
        base = passes[False][name]
        return passes[True][name] / base if base else 0.0

    ratios = [ratio(passes, "output_throughput") for passes in rounds]
    median = statistics.median(ratios)
    print(f"{args.base_url}, the base model `{args.model}`")
    print(table(rounds[0][False]))
    print(
        f"\nthe same load, each request on one of {len(args.lora_modules)} adapters: {' '.join(args.lora_modules)}"
    )
    print(table(rounds[0][True]))
    print(f"\n{'Output throughput ratio by round:':<40}{', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"{'Output throughput, adapters / base:':<40}{median:.3f}")
    if args.output_json:
        report = {
            "rounds": [
                {"base": p[False], "adapters": p[True], "output_throughput_ratio": r}
                for p, r in zip(rounds, ratios, strict=True)
            ],
            "output_throughput_ratio": median,
        }
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    failed = sum(p["failed"] for passes in rounds for p in passes.values())
    return 0 if failed == 0 else 1
