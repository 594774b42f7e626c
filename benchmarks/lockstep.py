"""Decode steps of engine variants side by side: in-process engines stepping in lockstep over the same
prompts, so that a VM whose speed drifts within minutes slows them alike.

    python -m benchmarks.lockstep [--variants 16:4k 64] [--concurrency 64] [--rounds 3]

A variant is a KV block size, optionally `:4k` for the KV cache and the pair-layout weights on the
default pages instead of 2 MiB ones (worker/host_memory.py), and `:variant` for the batch-variant
kernels (`--no-batch-invariant`: MKL, oneDNN, tiles; docs/batch-invariance.md). Every engine holds the same number of KV
tokens, and its free block queue is shuffled first (`--fresh-pool` keeps it in order): a server whose
pool has cycled hands out blocks in no order (benchmarks/results/2026-11-29-lab-notes-performance.md, "Huge
pages and 64-token blocks").
Each round adds `--concurrency` random prompts to every engine and steps them in turn, whose turn comes
first rotating step by step, until all finish. It prints each variant's median decode step (steps
after every request has its first token), its ratio to the first variant's, and the round's time.
"""

from __future__ import annotations

import argparse
import collections
import mmap
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from engine_core.engine_core import EngineCore
from frontend.model_files import resolve_model
from protocol.config import EngineConfig, WorkerConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from worker.executor import InprocExecutor
from worker.models.layers import Linear
from worker.models.native import native_weights


@dataclass
class Variant:
    name: str
    block_size: int
    default_pages: bool
    batch_invariant: bool = True
    core: EngineCore | None = None
    decode_ms: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    size, *options = text.split(":")
    if not size.isdigit() or not set(options) <= {"4k", "variant"}:
        raise argparse.ArgumentTypeError(f"a variant is BLOCK_SIZE[:4k][:variant], got {text!r}")
    return Variant(text, int(size), "4k" in options, "variant" not in options)


def build(variant: Variant, args: argparse.Namespace) -> EngineCore:
    worker = WorkerConfig(
        model=resolve_model(args.model),
        dtype=args.dtype,
        block_size=variant.block_size,
        num_kv_blocks=args.kv_tokens // variant.block_size,
        max_model_len=1024,
        batch_invariant=variant.batch_invariant,
    )
    config = EngineConfig(worker=worker, max_num_seqs=args.concurrency, max_num_batched_tokens=args.budget)
    core = EngineCore(config, InprocExecutor(worker))
    if variant.default_pages:
        move_to_default_pages(core)
    if not args.fresh_pool:
        pool = core.scheduler.kv_cache.pool
        ids = list(pool.free_queue)
        random.Random(args.seed).shuffle(ids)
        pool.free_queue = collections.OrderedDict((i, pool.blocks[i]) for i in ids)
    return core


def move_to_default_pages(core: EngineCore) -> None:
    """Copy the KV cache and the pair-layout weights into fresh mappings, not advised for huge pages."""
    runner = core.executor.runner  # type: ignore[attr-defined]
    runner.kv_caches = [on_default_pages(cache) for cache in runner.kv_caches]
    model = runner.model
    for module in model.modules():
        if isinstance(module, Linear) and module.pairs is not None:
            module.pairs = on_default_pages(module.pairs)
    if model.native_layers is not None:
        model.native_layers = [native_weights(layer) for layer in model.layers]


def on_default_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in an anonymous mapping of its own.
    NOTE: not malloc's memory (torch.clone): with the thresholds raised, malloc serves it from heap pages
    that an earlier buffer advised for huge pages, and the copy is on huge pages after all (CI, 12-04)."""
    num_bytes = tensor.numel() * tensor.element_size()
    raw = torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=torch.uint8)  # the tensor keeps it alive
    return raw.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def run_round(variants: list[Variant], args: argparse.Namespace, round_index: int) -> None:
    rng = random.Random(args.seed * 1000 + round_index)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    spread = args.input_len // 10
    prompts = [
        [rng.randrange(1000, 20000) for _ in range(args.input_len + rng.randint(-spread, spread))]
        for _ in range(args.concurrency)
    ]
    started: dict[str, set[str]] = {}
    for variant in variants:
        assert variant.core is not None
        for i, prompt in enumerate(prompts):
            variant.core.add_request(
                AddRequest(
                    request_id=f"{round_index}-{i}",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    arrival_time=0,
                )
            )
        started[variant.name] = set()
        variant.round_s.append(0.0)
    step = 0
    while any(v.core is not None and v.core.has_unfinished_requests() for v in variants):
        shift = step % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            assert variant.core is not None
            if not variant.core.has_unfinished_requests():
                continue
            decoding = len(started[variant.name]) == len(prompts)
            begin = time.perf_counter()
            outputs = variant.core.step()
            elapsed = time.perf_counter() - begin
            variant.round_s[-1] += elapsed
            if decoding:
                variant.decode_ms.append(elapsed * 1e3)
            started[variant.name].update(output.request_id for _, output in outputs if output.new_token_ids)
        step += 1


def main(argv: list[str] | None = None) -> list[Variant]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", nargs="+", type=parse_variant, default=[parse_variant("16:4k"), parse_variant("64")]
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100, help="prompt tokens, +-10%%")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=256, help="token budget of a step (engine serve's)")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV tokens of each engine")
    parser.add_argument("--fresh-pool", action="store_true", help="keep each free block queue in order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants: list[Variant] = args.variants
    if len({v.name for v in variants}) != len(variants):
        parser.error("the variants must differ")
    for variant in variants:
        variant.core = build(variant, args)
    for round_index in range(args.rounds):
        run_round(variants, args, round_index)
        line = ", ".join(f"{v.name} {statistics.median(v.decode_ms):.2f} ms" for v in variants if v.decode_ms)
        print(f"round {round_index + 1}: decode step medians so far: {line}", flush=True)
    base = statistics.median(variants[0].decode_ms) if variants[0].decode_ms else float("nan")
    base_round = statistics.median(variants[0].round_s)
    print(f"c={args.concurrency}, {args.input_len} in, {args.output_len} out, {args.rounds} rounds:")
    for variant in variants:
        decode = statistics.median(variant.decode_ms) if variant.decode_ms else float("nan")
        print(
            f"  {variant.name:8} decode step {decode:7.2f} ms ({decode / base:.3f}x)"
            f"  round {statistics.median(variant.round_s):6.2f} s ({statistics.median(variant.round_s) / base_round:.3f}x)"
        )
    return variants


if __name__ == "__main__":
    main()
