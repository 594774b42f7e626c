"""`engine bench serve --endpoint responses --responses-store both`: what keeping a response costs.

Each round sends the same load through /v1/responses twice, once with store: true and once with
store: false, each pass with fresh prompts of the same shapes (so the prefix cache favours neither);
in rounds the two take turns going first (true, false, false, true, ...), so a machine that speeds up
or slows down over the run does not tilt the ratio one way. It prints each round's throughput ratio
(store: true over store: false) and their median. `bench serve` hands it its pass and its table (so
this module imports nothing of serve's, and the command reaches it without an import cycle).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from frontend.bench.common import alternating_rounds

# (args, prompt seed) -> (summary, each request's result): one pass of the load
Measure = Callable[[argparse.Namespace, int], tuple[dict[str, Any], list[Any]]]


def store_cost(stored: dict[str, Any], unstored: dict[str, Any]) -> dict[str, float]:
    """What storing adds at the same load: latency differences (s) and throughput ratios."""

    def ratio(name: str) -> float:
        return stored[name] / unstored[name] if unstored[name] else 0.0

    return {
        "ttft_mean_s": stored["ttft_s"]["mean"] - unstored["ttft_s"]["mean"],
        "itl_mean_s": stored["itl_s"]["mean"] - unstored["itl_s"]["mean"],
        "e2el_mean_s": stored["e2el_s"]["mean"] - unstored["e2el_s"]["mean"],
        "output_throughput_ratio": ratio("output_throughput"),
        "request_throughput_ratio": ratio("request_throughput"),
    }


def store_pass(args: argparse.Namespace, measure: Measure, store: bool, seed: int) -> dict[str, Any]:
    summary, results = measure(argparse.Namespace(**{**vars(args), "responses_store": store}), seed)
    return {"summary": summary, "results": results}


def compare_store(args: argparse.Namespace, measure: Measure, table: Callable[[dict[str, Any]], str]) -> int:
    rounds = alternating_rounds(
        args.rounds, args.seed, True, lambda store, seed: store_pass(args, measure, store, seed)
    )
    costs = [store_cost(passes[True]["summary"], passes[False]["summary"]) for passes in rounds]
    cost = {name: statistics.median(c[name] for c in costs) for name in costs[0]}
    first = rounds[0]
    print(f"{args.base_url}/v1/responses, store: true")
    print(table(first[True]["summary"]))
    print("\nthe same load, store: false")
    print(table(first[False]["summary"]))
    print(f"\nstore cost (store: true against store: false, same load), the median of {args.rounds} rounds")
    for name, title in (("output_throughput_ratio", "Output"), ("request_throughput_ratio", "Request")):
        ratios = ", ".join(f"{c[name]:.3f}" for c in costs)
        print(f"{title + ' throughput ratio by round:':<36}{ratios}")
        print(f"{title + ' throughput, true / false:':<36}{cost[name]:.3f}")
    print(
        f"{'TTFT / E2E mean (ms):':<36}{1000 * cost['ttft_mean_s']:+.1f} / {1000 * cost['e2el_mean_s']:+.1f}"
    )
    print(f"{'ITL mean (ms):':<36}{1000 * cost['itl_mean_s']:+.2f}")
    if args.output_json:
        report = {
            "summary": first[True]["summary"],
            "no_store_summary": first[False]["summary"],
            "store_cost": cost,
            "rounds": [
                {"summary": p[True]["summary"], "no_store_summary": p[False]["summary"], "store_cost": c}
                for p, c in zip(rounds, costs, strict=True)
            ],
            "requests": [asdict(r) for r in first[True]["results"]],
        }
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    failed = sum(p["summary"]["failed"] for passes in rounds for p in passes.values())
    return 0 if failed == 0 else 1
