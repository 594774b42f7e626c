"""What each family's decode step costs beside Llama's, at the same size, in one invocation:

    python -m benchmarks.family_steps [--families llama gemma2 ...] [--dtype bfloat16] [--steps 30]

Every family is built at SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads and 3 KV heads, MLP 1536,
vocabulary 49,152) with random weights by transformers, with its quirks as its real checkpoints have them
(windows of 512 keys, Gemma 2's soft-caps, ...), and run in-process (no HTTP, no worker process): the
median wall-clock time of a decode step at c=1 and c=16 (prompts of 100 tokens, greedy), its ratio to
Llama's measured in the same invocation, and whether the csrc decoder stack served it. A second Llama line
runs the Python layers (the stack turned off): the cost of leaving the stack, which every family that runs
the Python layers pays. Writes benchmarks/results/family_steps.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time
from typing import Any

import torch

SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
)  # fmt: skip
WINDOWS = ["sliding_attention", "full_attention"] * 15
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "mistral (window 512)": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 512}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "sliding_window": 512, "query_pre_attn_scalar": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "sliding_window": 512, "query_pre_attn_scalar": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                                        "attention_multiplier": 0.015625, "logits_scaling": 8.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 64}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": 9}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
}  # fmt: skip


def build(name: str, folder: str) -> None:
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    getattr(transformers, model_class)(config).to(torch.bfloat16).save_pretrained(folder)


def step_times(folder: str, dtype: str, batch: int, steps: int, native: bool = True) -> tuple[float, bool]:
    from engine_core.engine_core import EngineCore
    from protocol.config import EngineConfig, WorkerConfig
    from protocol.messages import AddRequest
    from protocol.sampling import SamplingParams
    from worker.executor import InprocExecutor

    worker = WorkerConfig(model=folder, dtype=dtype, block_size=64, num_kv_blocks=256, max_model_len=1024)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    model = core.executor.runner.model  # type: ignore[attr-defined]
    if not native:
        model.native_layers = None
    served_native = model.native_layers is not None
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(100)]
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=0)
        )
    for _ in range(8):  # the prefill, then warm decode steps
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    core.shutdown()
    return statistics.median(times), served_native


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/family_steps.json")
    args = parser.parse_args()
    names = ["llama", *[n for n in args.families if n != "llama"]]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            folder = str(pathlib.Path(root) / name.split()[0])
            build(name, folder)
            variants = [(name, True), ("llama, Python layers", False)] if name == "llama" else [(name, True)]
            for label, native in variants:
                c1, served = step_times(folder, args.dtype, 1, args.steps, native)
                c16, _ = step_times(folder, args.dtype, 16, args.steps, native)
                rows.append(
                    {"family": label, "c1_ms": 1000 * c1, "c16_ms": 1000 * c16, "native_stack": served}
                )
                base = rows[0]
                print(f"{label:24s} c=1 {1000 * c1:7.1f} ms ({c1 * 1000 / base['c1_ms']:.2f}x llama)   "
                      f"c=16 {1000 * c16:7.1f} ms ({c16 * 1000 / base['c16_ms']:.2f}x llama)   "
                      f"{'csrc stack' if served else 'Python layers'}", flush=True)  # fmt: skip
    pathlib.Path(args.out).write_text(
        json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
