"""Each GGUF type's packed products (csrc/quant_cpu.cpp) against the bf16 products of the same weights, on
this CPU, the kinds taken in turn in one process:

    python -m benchmarks.gguf_types [--rows 1 16] [--rounds 7] [--types Q4_K Q5_0 ...] [--int8]

A stack of 24 random [2048, 2048] weights (192 MiB in bf16, more than the caches hold), written as each
type's random blocks (tests/test_kernels_quant.py's random_blocks) and packed as a worker packs them; bf16
rows through every weight of the stack, per kind: the median time (ms), its ratio to bf16's pair layout
(`linear_pairs` where the build has AVX-512 BF16, else oneDNN), and the bytes held and read per second.
Q3_K is held as the Q6_K blocks of its values (worker/quant/gguf_pack.py), so its row is Q6_K's. --int8 adds
each type's product with int8 activations (`TYPE/i8`, csrc/quant_a8.cpp: --activation-quantization int8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf.quants import dequantize

from worker.csrc_ops import load_cpu_ops
from worker.quant.gguf_pack import Q, pack, q3_k_as_q6_k

SIZE, COUNT = 2048, 24
TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q5_0, Q.Q8_0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--types", nargs="+", default=[t.name for t in TYPES], choices=[t.name for t in TYPES]
    )
    parser.add_argument("--int8", action="store_true", help="also each type with int8 activations")
    args = parser.parse_args()
    from tests.test_kernels_quant import random_blocks

    ops = load_cpu_ops(build=True)
    assert ops is not None, "the csrc kernels did not build"
    kinds: dict[str, tuple[Callable[[torch.Tensor], None], int]] = {}  # name: (run the stack, bytes held)
    dense = [
        torch.from_numpy(np.asarray(dequantize(random_blocks(Q.Q4_K, SIZE, SIZE, seed=i), Q.Q4_K)))
        .reshape(SIZE, SIZE)
        .to(torch.bfloat16)
        for i in range(COUNT)
    ]
    no_bias = torch.empty(0)

    def stack(product: Callable[[torch.Tensor, torch.Tensor], object], weights: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor) -> None:
            for weight in weights:
                product(x, weight)

        return run

    if ops.pairs_available():
        pairs = [ops.pack_pairs(w) for w in dense]
        kinds["bf16"] = (stack(lambda x, w: ops.linear_pairs(x, w, no_bias), pairs), 2 * SIZE**2 * COUNT)
    else:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in dense]
        linear = torch.ops.mkldnn._linear_pointwise
        kinds["bf16"] = (stack(lambda x, w: linear(x, w, None, "none", [], ""), onednn), 2 * SIZE**2 * COUNT)
    del dense
    for qtype in (Q[name] for name in args.types):
        stored = int(Q.Q6_K if qtype == Q.Q3_K else qtype)
        held = []
        for i in range(COUNT):
            raw = random_blocks(qtype, SIZE, SIZE, seed=i)
            raw = q3_k_as_q6_k(raw) if qtype == Q.Q3_K else raw
            held.append(torch.from_numpy(pack(raw, stored, (SIZE, SIZE))))

        def product(x: torch.Tensor, packed: torch.Tensor, stored: int = stored) -> None:
            ops.linear_quant(x, packed, stored, no_bias, SIZE)

        kinds[qtype.name] = (stack(product, held), sum(p.numel() for p in held))
        if args.int8:

            def product_a8(x: torch.Tensor, packed: torch.Tensor, stored: int = stored) -> None:
                ops.linear_quant_a8(x, packed, stored, no_bias, SIZE)

            kinds[f"{qtype.name}/i8"] = (stack(product_a8, held), sum(p.numel() for p in held))
    print(f"{COUNT} x [{SIZE}, {SIZE}] products, bf16 rows; median of {args.rounds} rounds", flush=True)
    for rows in args.rows:
        x = torch.randn(rows, SIZE).to(torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (run, _) in kinds.items():
                start = time.perf_counter()
                run(x)
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["bf16"][1:])
        for name, (_, nbytes) in kinds.items():
            ms = statistics.median(times[name][1:]) * 1000
            print(
                f"rows {rows:4}  {name:8} {ms:7.2f} ms  {ms / 1000 / base:5.2f}x bf16  "
                f"held {nbytes / 2**20:6.1f} MiB  {nbytes / ms / 1e6:5.1f} GB/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
