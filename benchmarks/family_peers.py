"""Each model family beside vLLM's CPU build on the same checkpoint, in one invocation:

    python -m benchmarks.family_peers [--models llama gemma2 ... gemma-3-270m] [--rounds 1]

Models: every family of benchmarks/family_steps.py at SmolLM2-135M's shape with random weights (bfloat16,
SmolLM2's tokenizer), and Gemma-3-270M (the packaged Q4_K_M GGUF, dequantized by transformers into a
bfloat16 Hugging Face folder). For each model, ours and vLLM are up side by side as in `make bench-peers`
(benchmarks/peers.py: the same client, completions with token-id prompts, greedy, ignore_eos, the turn
order reversed every round), on random prompts of 100 tokens with 64 output tokens at c=1 (8 prompts) and
c=16 (32 prompts), then ours' greedy invariance check (8 prompts alone, then among 48 others). The table: c=1 TPOT p50 and c=16
output tokens/s of each, ours/vLLM, and ours' invariance. A server that does not start (vLLM refusing an
architecture or a checkpoint field) is a row saying so. Writes benchmarks/results/family_peers.json and
family_peers.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks import family_steps, peers

GEMMA3_270M = "gemma-3-270m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def model_folder(name: str, cache: Path) -> Path:
    """A bfloat16 Hugging Face folder of the model, built once under the cache."""
    folder = cache / "family-models" / name.replace(" ", "_").replace("(", "").replace(")", "")
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if name == GEMMA3_270M:
        gguf_to_hf(tmp)
    else:
        family_steps.build(name, str(tmp))
        smollm2 = peers.hf_folder(cache)  # the families share SmolLM2's vocabulary (49,152)
        for file in TOKENIZER_FILES:
            if (smollm2 / file).exists():
                shutil.copy(smollm2 / file, tmp / file)
    tmp.rename(folder)
    return folder


def gguf_to_hf(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from frontend.model_files import resolve_model

    directory, file = os.path.split(resolve_model(GEMMA3_270M))
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=file, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(directory, gguf_file=file).save_pretrained(folder, save_jinja_files=False)


def one_model(name: str, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    folder = model_folder(name, cache)
    print(f"== {name} ({folder})", flush=True)
    started = time.monotonic()
    rounds = peers.side_by_side(args, cache, folder)
    servers = {server: peers.combine_rounds(results) for server, results in rounds.items()}
    return {"servers": servers, "seconds": time.monotonic() - started}


def cell(summary: dict[str, Any], workload: str, key: str, scale: float) -> float | None:
    run = summary.get("runs", {}).get(workload)
    return peers.figure(run, key) * scale if run else None


def table(report: dict[str, Any]) -> str:
    c1, c16 = "random c=1", "random c=16"
    lines = [
        "| model | c=1 TPOT p50 ms, ours | vLLM | ours/vLLM (lower is faster) "
        "| c=16 out tok/s, ours | vLLM | ours/vLLM | ours greedy alone = under load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result in report["models"].items():
        ours, vllm = result["servers"].get("ours", {}), result["servers"].get("vllm", {})
        values = [
            cell(ours, c1, "tpot_s.p50", 1000.0),
            cell(vllm, c1, "tpot_s.p50", 1000.0),
            cell(ours, c16, "output_throughput", 1.0),
            cell(vllm, c16, "output_throughput", 1.0),
        ]
        text = [f"{v:.1f}" if v is not None else "n/a" for v in values]
        tpot = f"{values[0] / values[1]:.2f}x" if values[0] and values[1] else "n/a"
        rate = f"{values[2] / values[3]:.2f}x" if values[2] and values[3] else "n/a"
        check = ours.get("invariance")
        same = f"{check['same']:.0f} of {check['of']:.0f}" if check else "n/a"
        lines.append(f"| {name} | {text[0]} | {text[1]} | {tpot} | {text[2]} | {text[3]} | {rate} | {same} |")
        for server, summary in result["servers"].items():
            if "error" in summary:
                lines.append(f"| {name} | {server} did not serve: {summary['error'][:200]} |||||||")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=[*family_steps.FAMILIES, GEMMA3_270M])
    parser.add_argument("--servers", nargs="+", default=["ours", "vllm"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=32, help="at c > 1 (at c=1: --c1-prompts)")
    parser.add_argument("--c1-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/engine/peers"))
    parser.add_argument("--results-dir", default="benchmarks/results")
    args = parser.parse_args()
    # what peers.side_by_side and its workloads read: no shared-prefix run
    args.input_len, args.prefix_len, args.seed = 100, 0, int(time.time()) % 100000
    args.prompts_at, args.invariance_of = {1: args.c1_prompts}, ["ours"]
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if "vllm" in args.servers:
        peers.vllm_python(cache)
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": peers.machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("cache_dir", "results_dir")},
        "models": {},
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        report["models"][name] = one_model(name, args, cache)
        (out / "family_peers.json").write_text(json.dumps(report, indent=2))  # a model at a time
    text = table(report)
    (out / "family_peers.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
