"""What a mixture-of-experts step costs, in one invocation:

    python -m benchmarks.moe_steps [--dtype bfloat16] [--steps 30]

1. The decode step of Qwen3-MoE- and gpt-oss-shaped models (~270M parameters, ~70M active: 16 layers,
   hidden 576, 32 experts of width 256, 4 a token; benchmarks/family_steps.py builds them with random
   weights) against the dense Qwen3 of their active size (MLP 4 x 256 = 1024), in-process at c=1 and
   c=16, their steps taken in turn (family_steps.compare).
3. The experts of all 16 layers from memory (a 64 MB buffer written between runs), at 1 and 16 rows: the
   bytes of the experts the rows touch over the time, GB/s, beside a plain sum's read of 400 MB.
2. The experts alone (one layer's, x [T, 576]): csrc fused_experts against transformers' per-expert torch
   loop on the same weights, and against the dense MLP of the active size on oneDNN-packed products
   (gate/up 576 -> 2048, SiLU-and-mul, down 1024 -> 576), at T = 1, 16 and 64 rows, 4 experts a row.

Writes benchmarks/results/moe_steps.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import family_steps

HIDDEN, EXPERTS, TOP, WIDTH = 576, 32, 4, 256


def median_ms(run: Callable[[], Any], repeats: int = 200) -> float:
    for _ in range(10):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def experts_alone(dtype: torch.dtype) -> list[dict[str, Any]]:
    from worker.csrc_ops import load_cpu_ops
    from worker.model_config import ModelConfig
    from worker.models.experts import Experts
    from worker.models.layers import Linear

    ops = load_cpu_ops()
    assert ops is not None, "the csrc kernels are needed"
    config = ModelConfig(family="qwen3_moe", vocab_size=16, hidden_size=HIDDEN, intermediate_size=WIDTH,
                         num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                         num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    loop, fused = Experts(config, dtype, None), Experts(config, dtype, ops)
    for name, param in loop.named_parameters():
        value = (0.05 * torch.randn(param.shape, generator=generator)).to(dtype)
        getattr(loop, name).data.copy_(value)
        getattr(fused, name).data.copy_(value)
    fused.pack()
    gate_up, down = (
        Linear(HIDDEN, 2 * TOP * WIDTH, bias=False, dtype=dtype),
        Linear(TOP * WIDTH, HIDDEN, bias=False, dtype=dtype),
    )
    for linear in (gate_up, down):
        linear.weight.data.copy_((0.05 * torch.randn(linear.weight.shape, generator=generator)).to(dtype))
        linear.pack(ops)
    rows = []

    def dense(x: torch.Tensor) -> torch.Tensor:
        return down(ops.silu_and_mul(gate_up(x)))

    for tokens in (1, 16, 64):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, TOP, generator=generator), dim=-1)
        with torch.no_grad():
            row = {
                "rows": tokens,
                "fused_ms": median_ms(functools.partial(fused, x, ids, weights)),
                "torch_loop_ms": median_ms(functools.partial(loop, x, ids, weights), 50),
                "dense_active_ms": median_ms(functools.partial(dense, x)),
            }
        row["experts_present"] = int(torch.unique(ids).numel())
        rows.append(row)
        print(f"experts alone, {tokens:2d} rows ({row['experts_present']:2d} experts): fused "
              f"{row['fused_ms']:.3f} ms, torch loop {row['torch_loop_ms']:.3f} ms "
              f"({row['torch_loop_ms'] / row['fused_ms']:.1f}x the fused), dense of the active size on oneDNN "
              f"{row['dense_active_ms']:.3f} ms (fused / dense {row['fused_ms'] / row['dense_active_ms']:.2f})",
              flush=True)  # fmt: skip
    return rows


def experts_from_memory(dtype: torch.dtype) -> list[dict[str, Any]]:
    from worker.csrc_ops import load_cpu_ops
    from worker.model_config import ModelConfig
    from worker.models.experts import Experts

    ops = load_cpu_ops()
    config = ModelConfig(family="qwen3_moe", vocab_size=16, hidden_size=HIDDEN, intermediate_size=WIDTH,
                         num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                         num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(16):
        layer = Experts(config, dtype, ops)
        for name, param in layer.named_parameters():
            getattr(layer, name).data.copy_((0.05 * torch.randn(param.shape, generator=generator)).to(dtype))
        layer.pack()
        layers.append(layer)
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    plain = torch.ones(100 << 20, dtype=torch.float32)  # 400 MB
    rows = []
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, TOP, generator=generator), dim=-1)

        def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
            flush.add_(1)
            for layer in layers:
                layer(x, ids, weights)

        touched = int(torch.unique(ids).numel())
        megabytes = 16 * touched * 3 * HIDDEN * WIDTH * dtype.itemsize / 1e6
        ms = median_ms(functools.partial(run, x, ids, weights), 20) - median_ms(
            functools.partial(flush.add_, 1), 20
        )
        sum_ms = median_ms(plain.sum, 10)
        rows.append({"rows": tokens, "experts": touched, "ms": ms, "megabytes": megabytes,
                     "gb_per_s": megabytes / ms, "plain_sum_gb_per_s": 400 / sum_ms})  # fmt: skip
        print(
            f"16 layers' experts from memory, {tokens:2d} rows ({touched} experts a layer): {ms:.2f} ms for "
            f"{megabytes:.0f} MB, {megabytes / ms:.1f} GB/s (a plain sum: {400 / sum_ms:.1f} GB/s)",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/moe_steps.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"dtype": args.dtype, "threads": torch.get_num_threads(), "steps": []}
    result["experts_alone"] = experts_alone(getattr(torch, args.dtype))
    result["experts_from_memory"] = experts_from_memory(getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as root:
        for name in ("qwen3_dense_active", "qwen3_moe", "gpt_oss"):
            family_steps.build(name, f"{root}/{name}")
        for name in ("qwen3_moe", "gpt_oss"):
            row: dict[str, Any] = {"model": name}
            for batch in (1, 16):
                moe = family_steps.engine(f"{root}/{name}", args.dtype, batch, args.steps)
                dense = family_steps.engine(f"{root}/qwen3_dense_active", args.dtype, batch, args.steps)
                mine, theirs = family_steps.compare(moe, dense, args.steps)
                moe.shutdown()
                dense.shutdown()
                row[f"c{batch}_ms"], row[f"c{batch}_dense_ms"] = 1000 * mine, 1000 * theirs
            result["steps"].append(row)
            print(f"{name:10s} c=1 {row['c1_ms']:6.1f} ms vs dense of its active size {row['c1_dense_ms']:6.1f} "
                  f"({row['c1_ms'] / row['c1_dense_ms']:.2f}x)   c=16 {row['c16_ms']:6.1f} ms vs "
                  f"{row['c16_dense_ms']:6.1f} ({row['c16_ms'] / row['c16_dense_ms']:.2f}x)", flush=True)  # fmt: skip
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
