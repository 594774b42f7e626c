"""What the data-parallel routing decision costs an API server per request (frontend/engine/router.py):
Router.choose on prompts of 128, 1,024 and 4,096 tokens over 2 and 8 engines, half of the prompts sharing
a long prefix (the affinity lookups hit) and half fresh, against the baseline every request pays anyway
in the same run: msgspec-encoding its AddRequest for the engine.

    python -m benchmarks.dp_routing [--requests 2000]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

from frontend.engine.router import Router
from protocol.codec import frontend_codec
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams


def per_request_us(work: list[object], run: object) -> float:
    """Median of five passes over `work`, in µs per item."""
    passes = []
    for _ in range(5):
        started = time.perf_counter()
        for item in work:
            run(item)  # type: ignore[operator]
        passes.append((time.perf_counter() - started) / len(work) * 1e6)
    return statistics.median(passes)


def choose(router: Router, loads: list[int], prompt: list[int]) -> int:
    return router.choose(prompt, loads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    codec = frontend_codec()
    print(f"{'prompt':>7} {'engines':>7} {'route µs':>9} {'encode µs':>10} {'route / encode':>15}")
    for length in (128, 1024, 4096):
        shared = [rng.randrange(49152) for _ in range(length // 2)]
        prompts = [
            (shared if i % 2 else [])
            + [rng.randrange(49152) for _ in range(length - (len(shared) if i % 2 else 0))]
            for i in range(args.requests)
        ]
        requests = [
            AddRequest(
                request_id=f"r{i}",
                prompt_token_ids=p,
                sampling_params=SamplingParams(max_tokens=64),
                arrival_time=0.0,
            )
            for i, p in enumerate(prompts)
        ]
        encode = per_request_us(requests, codec.encode)  # type: ignore[arg-type]
        for engines in (2, 8):
            router = Router(engines, 64)
            loads = [rng.randrange(8) for _ in range(engines)]
            route = per_request_us(prompts, functools.partial(choose, router, loads))
            print(f"{length:>7} {engines:>7} {route:>9.1f} {encode:>10.1f} {route / encode:>14.2f}x")


if __name__ == "__main__":
    main()
