"""The csrc kernels against what they replace, on this CPU, the two alternating in one process:

    python -m benchmarks.cpu_kernels [--rows 1 16 64 256] [--rounds 7] [--parts products prefill encoder]

- products: a SmolLM2 decode step's 121 bf16 products (30 layers' own weights, and the logits) at each
  row count, oneDNN's packed weights against the pair layout (`csrc/gemm_cpu.cpp`, where the build has
  AVX-512 BF16) and the AMX tiles on that layout (`csrc/gemm_amx_cpu.cpp`, where the CPU has AMX);
- prefill attention: 30 layers of paged prefill rows in four shapes, the rows one by one against each
  kind of tiles this CPU runs (`use_prefill_tiles`: AVX-512 BF16, AMX);
- encoder attention: one layer of an encoder's bidirectional attention (all-MiniLM-L6-v2's 28 inputs of
  40-110 tokens, Whisper-base's 1,500 frames, a CLIP tower's 1,025 positions), torch's SDPA a call per
  input against csrc
  `encoder_attention` (`csrc/encoder_attention_cpu.cpp`), in bf16 and float32.

Prints medians (ms) and each candidate's ratio to the first column. The reading:
benchmarks/results/2026-11-29-lab-notes-performance.md, "On a CPU without AMX".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from worker.csrc_ops import load_cpu_ops

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def timed(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return 1000 * (time.perf_counter() - start)


def report(name: str, times: dict[str, list[float]]) -> None:
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    base = next(iter(medians.values()))
    cells = [f"{kind} {ms:.1f} ms ({ms / base:.2f}x)" for kind, ms in medians.items()]
    print(f"{name:28} " + "  ".join(cells), flush=True)


def products(ops: Any, rows: list[int], rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator) * 0.02).to(torch.bfloat16)

    plain = [[weight(*shape) for shape in SHAPES] for _ in range(LAYERS)] + [[weight(VOCAB, HIDDEN)]]
    shapes = [SHAPES] * LAYERS + [[(VOCAB, HIDDEN)]]
    kinds: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
    packed: dict[str, list[list[torch.Tensor]]] = {}
    linear = torch.ops.mkldnn._linear_pointwise
    kinds["oneDNN"] = lambda x, w: linear(x, w, None, "none", [], "")
    packed["oneDNN"] = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in plain]
    if ops.pairs_available():
        no_bias = torch.empty(0)
        kinds["pairs"] = lambda x, w: ops.linear_pairs(x, w, no_bias)
        packed["pairs"] = [[ops.pack_pairs(w) for w in ws] for ws in plain]
    if ops.has_amx():
        no_bias = torch.empty(0)
        kinds["amx"] = lambda x, w: ops.linear_amx(x, w, no_bias)
        packed["amx"] = packed["pairs"]

    def step(kind: str, inputs: dict[int, torch.Tensor]) -> None:
        for layer_weights, layer_shapes in zip(packed[kind], shapes, strict=True):
            for w, (_, in_features) in zip(layer_weights, layer_shapes, strict=True):
                kinds[kind](inputs[in_features], w)

    print(f"a decode step's products ({sum(map(len, shapes))} of them), per row count:")
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator).to(torch.bfloat16) for k in (HIDDEN, INTER)}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind in kinds:
                times[kind].append(timed(step, kind, inputs))
        report(f"  {m} rows", times)


def prefill_attention(ops: Any, rounds: int) -> None:
    generator = torch.Generator().manual_seed(1)
    num_blocks = 1024
    caches = [
        torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    cases = {
        "16 fresh x 100": [(0, 100)] * 16,
        "15 x 64 after 512 cached": [(512, 64)] * 15,
        "2 fresh x 1,024": [(0, 1024)] * 2,
        "1 fresh x 2,000": [(0, 2000)],
    }
    kinds = ["none"]
    for kind in ("avx512_bf16", "amx"):
        try:
            ops.use_prefill_tiles(kind)
            kinds.append(kind)
        except RuntimeError:
            pass

    def layers(query: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        for cache in caches:
            ops.paged_decode_attention(query, cache, table, seq_lens, 0.125, 0, 0.0, torch.empty(0))

    print("prefill attention, 30 layers, rows one by one ('none') against the tiles:")
    for name, chunks in cases.items():
        width = max(-(-(context + n) // BLOCK) for context, n in chunks)
        perm = torch.randperm(num_blocks, generator=generator)
        tables, lens = [], []
        for i, (context, n) in enumerate(chunks):
            for j in range(n):
                tables.append(perm[i * width : (i + 1) * width])
                lens.append(context + j + 1)
        query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        table, seq_lens = torch.stack(tables), torch.tensor(lens)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind in kinds:
                ops.use_prefill_tiles(kind)
                times[kind].append(timed(layers, query, table, seq_lens))
        report(f"  {name}", times)
    ops.use_prefill_tiles("auto")


def encoder_attention(ops: Any, rounds: int) -> None:
    generator = torch.Generator().manual_seed(2)
    cases = {  # (heads, head_dim, each input's tokens)
        "MiniLM, 28 x 40-110": (12, 32, torch.randint(40, 111, (28,), generator=generator).tolist()),
        "Whisper-base, 1 x 1,500": (8, 64, [1500]),
        "CLIP-B/14 at 448, 1 x 1,025": (12, 64, [1025]),
    }

    def sdpa(qkv: torch.Tensor, heads: int, segments: list[tuple[int, int]]) -> None:
        x = qkv.view(qkv.shape[0], 3, heads, -1)
        for start, end in segments:
            q, k, v = x[start:end].permute(1, 2, 0, 3).contiguous().unsqueeze(1).unbind(0)
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def csrc(qkv: torch.Tensor, heads: int, segments: list[tuple[int, int]]) -> None:
        third = qkv.shape[1] // 3
        q, k, v = qkv[:, :third], qkv[:, third : 2 * third], qkv[:, 2 * third :]
        ops.encoder_attention(q, k, v, torch.tensor(segments), heads, (third // heads) ** -0.5)

    print("encoder attention, one layer, torch's SDPA per input against csrc encoder_attention:")
    for name, (heads, dim, lengths) in cases.items():
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        segments = list(zip(bounds[:-1], bounds[1:], strict=True))
        for dtype in (torch.bfloat16, torch.float32):
            qkv = torch.randn(bounds[-1], 3 * heads * dim, generator=generator).to(dtype)
            times: dict[str, list[float]] = {"sdpa": [], "encoder_attention": []}
            with torch.inference_mode():
                for _ in range(rounds):
                    times["sdpa"].append(timed(sdpa, qkv, heads, segments))
                    times["encoder_attention"].append(timed(csrc, qkv, heads, segments))
            report(f"  {name} {str(dtype).removeprefix('torch.')}", times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", nargs="+", default=["products", "prefill", "encoder"],
                        choices=["products", "prefill", "encoder"])  # fmt: skip
    args = parser.parse_args()
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the csrc kernels did not build here: nothing to compare")
    print(f"torch threads: {torch.get_num_threads()}; prefill tiles here: {ops.prefill_tiles() or 'none'}")
    if "products" in args.parts:
        products(ops, args.rows, args.rounds)
    if "prefill" in args.parts:
        prefill_attention(ops, args.rounds)
    if "encoder" in args.parts:
        encoder_attention(ops, args.rounds)


if __name__ == "__main__":
    main()
