"""What the serve benchmarks share: the words random prompts are made of, and percentiles."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue"
).split()


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def alternating_rounds(
    num_rounds: int, seed: int, first: bool, run: Callable[[bool, int], T]
) -> list[dict[bool, T]]:
    """Two passes a round, run(side, prompt seed) for side `first` and `not first`, taking turns going first
    (so a machine that speeds up or slows down over the run tilts neither), each with its own seed."""
    rounds = []
    for index in range(num_rounds):
        seeds = {True: seed + 2 * index * 7919, False: seed + (2 * index + 1) * 7919}
        order = [first, not first] if index % 2 == 0 else [not first, first]
        rounds.append({side: run(side, seeds[side]) for side in order})
    return rounds
