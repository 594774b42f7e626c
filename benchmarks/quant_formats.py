"""What a decode step costs with each quantized checkpoint format beside the bf16 model, in one invocation:

    python -m benchmarks.quant_formats [--steps 20] [--rounds 3]

The bundled SmolLM2-135M (its GGUF file dequantized to float32 by transformers) is quantized here as AWQ
(4-bit, groups of 64: 128 does not divide its 576 dims), GPTQ (4-bit, groups of 64; and in act-order, whose
products permute their inputs), compressed-tensors W4A16 (groups of 64) and W8A8 (int8 per channel,
activations per token) by tests/quant_writers.py, and served in-process beside the same model in bf16 (a folder of its float weights) and the GGUF file's Q4_1 blocks: the median wall-clock time
of a decode step at c=1 and c=16 (prompts of 100 tokens, greedy), each engine's steps taken in turn with the
bf16 one's, and the bytes its products hold. Writes benchmarks/results/quant_formats.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
from typing import Any

import torch

from benchmarks.family_steps import compare, engine

FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    "awq g64": ("awq", {"group": 64}),
    "gptq g64": ("gptq", {"group": 64, "symmetric": True}),
    "gptq g64 act-order": ("gptq", {"group": 64, "symmetric": True, "act_order": "input"}),
    "ct w4a16 g64": ("ct-pack", {"group": 64, "symmetric": True}),
    "ct w8a8": ("ct-int8", {"bits": 8, "group": -1}),
}


def product_bytes(core: Any) -> int:
    """The bytes the decoder layers' products hold (the embedding and the output matrix apart)."""
    total = 0
    for layer in core.executor.runner.model.layers:
        for module in layer.modules():
            if getattr(module, "quant", None) is not None:
                total += module.quant_nbytes
            elif isinstance(module, torch.nn.Linear):
                total += module.in_features * module.out_features * 2  # bf16
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/quant_formats.json")
    parser.add_argument(
        "--formats", nargs="+", default=None, help=f"a subset of: 'gguf q4_1' {' '.join(map(repr, FORMATS))}"
    )
    args = parser.parse_args()
    from tests.conftest import smollm2_path
    from tests.hf_oracle import hf_model_of_gguf
    from tests.quant_writers import write

    gguf = smollm2_path()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        dense = f"{root}/bf16"
        hf_model_of_gguf(gguf).save_pretrained(dense)
        variants = {"gguf q4_1": gguf}
        for label, (method, options) in FORMATS.items():
            if args.formats is not None and label not in args.formats:
                continue
            folder = f"{root}/{label.replace(' ', '-')}"
            write(hf_model_of_gguf(gguf), folder, method, **options)
            variants[label] = folder
        for label, folder in variants.items():
            if args.formats is not None and label not in args.formats:
                continue
            row: dict[str, Any] = {"format": label}
            for batch in (1, 16):
                core = engine(folder, "bfloat16", batch, args.steps)
                baseline = engine(dense, "bfloat16", batch, args.steps)
                row["native_stack"] = core.executor.runner.model.native_layers is not None
                row["product_mb"] = product_bytes(core) / 1e6
                row["bf16_product_mb"] = product_bytes(baseline) / 1e6
                mine, theirs = compare(core, baseline, args.steps, args.rounds)
                core.shutdown()
                baseline.shutdown()
                row[f"c{batch}_ms"], row[f"c{batch}_bf16_ms"] = 1000 * mine, 1000 * theirs
            rows.append(row)
            print(f"{label:14s} c=1 {row['c1_ms']:6.2f} ms vs bf16 {row['c1_bf16_ms']:6.2f} "
                  f"({row['c1_ms'] / row['c1_bf16_ms']:.2f}x)   c=16 {row['c16_ms']:6.2f} ms vs bf16 "
                  f"{row['c16_bf16_ms']:6.2f} ({row['c16_ms'] / row['c16_bf16_ms']:.2f}x)   products "
                  f"{row['product_mb']:.0f} MB vs {row['bf16_product_mb']:.0f}   "
                  f"{'csrc stack' if row['native_stack'] else 'Python layers'}", flush=True)  # fmt: skip
    pathlib.Path(args.out).write_text(
        json.dumps({"dtype": "bfloat16", "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
