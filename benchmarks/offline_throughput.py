"""Offline throughput: our engine vs Hugging Face transformers `generate`, same prompts, same run.

    python -m benchmarks.offline_throughput [--num-prompts 64] [--output-len 128] [--hf-batch-size 8]

Fixed seed, ~100-token prompts, ignore_eos, bf16. Prints output tokens/s for each and the ratio,
and writes JSON to benchmarks/results/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from frontend.bench.offline import random_prompts


def run_ours(model: str, prompts: list[list[int]], output_len: int, dtype: str) -> dict:
    from frontend import LLM
    from frontend.bench.offline import throughput

    start = time.perf_counter()
    with LLM(model, dtype=dtype, max_model_len=1024) as llm:
        load_s = time.perf_counter() - start
        report = throughput(llm, prompts, output_len)
    return {
        "output_tokens": report["total_output_tokens"],
        "seconds": report["elapsed_s"],
        "tokens_per_s": report["output_tokens_per_s"],
        "load_s": load_s,
    }


def run_hf(model: str, prompts: list[list[int]], output_len: int, dtype: str, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(model)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    pad = 0
    elapsed = 0.0
    num_output = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad,
            )
        elapsed += time.perf_counter() - start
        num_output += (out.shape[1] - width) * len(batch)
    return {"output_tokens": num_output, "seconds": elapsed, "tokens_per_s": num_output / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--hf-prompts", type=int, default=None, help="run HF on the first N prompts only")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    from frontend.model_files import resolve_model

    model = resolve_model(args.model)
    prompts = random_prompts(args.num_prompts, args.prompt_len, 0.1, random.Random(args.seed))
    result: dict = {
        "model": model,
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "dtype": args.dtype,
    }
    result["ours"] = run_ours(model, prompts, args.output_len, args.dtype)
    print(
        f"ours: {result['ours']['tokens_per_s']:.1f} output tokens/s ({result['ours']['seconds']:.1f} s)",
        flush=True,
    )
    if not args.skip_hf:
        hf_prompts = prompts[: args.hf_prompts] if args.hf_prompts else prompts
        result["hf"] = run_hf(model, hf_prompts, args.output_len, args.dtype, args.hf_batch_size)
        result["ratio"] = result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
        print(
            f"hf transformers generate (batch {args.hf_batch_size}): {result['hf']['tokens_per_s']:.1f} output tokens/s"
        )
        print(f"ratio ours/hf: {result['ratio']:.2f}x")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
