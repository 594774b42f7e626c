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
    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=None,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
WINDOWS = ["sliding_attention", "full_attention"] * 15
MOE = {"num_hidden_layers": 16, "head_dim": 64, "num_experts_per_tok": 4}
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
    "cohere (q/k norms)": ("CohereConfig", "CohereForCausalLM", {"use_qk_norm": True}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": 9}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "stablelm (q/k norms)": ("StableLmConfig", "StableLmForCausalLM", {"qk_layernorm": True}),
    # mixtures of experts, ~270M parameters with ~70M active (16 layers, 32 experts, 4 a token, each 256
    # wide), and the dense model of their active size (MLP 4 x 256): benchmarks/moe_steps.py
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 32, "moe_intermediate_size": 256,
                                                            "norm_topk_prob": True}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**MOE, "num_local_experts": 32, "intermediate_size": 256,
                                                      "sliding_window": 128}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**MOE, "n_routed_experts": 32,
                    "moe_intermediate_size": 256, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
                    "topk_group": 2, "intermediate_size": 1024, "kv_lora_rank": 512, "q_lora_rank": 192,
                    "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "num_key_value_heads": 9,
                    "topk_method": "noaux_tc"}),  # DeepSeek's latent width (512 + 64): vLLM's CPU MLA takes no other
    "qwen3_dense_active": ("Qwen3Config", "Qwen3ForCausalLM", {"num_hidden_layers": 16, "head_dim": 64,
                                                               "intermediate_size": 1024}),
}  # fmt: skip
MOE_FAMILIES = (
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_dense_active",
)  # of another size: moe_steps.py compares them


def build(name: str, folder: str) -> None:
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    getattr(transformers, model_class)(config).to(torch.bfloat16).save_pretrained(folder)


def engine(folder: str, dtype: str, batch: int, steps: int, native: bool = True) -> Any:
    """An in-process engine decoding `batch` requests of 100 random tokens, past its prefill."""
    from engine_core.engine_core import EngineCore
    from protocol.config import EngineConfig, WorkerConfig
    from protocol.messages import AddRequest
    from protocol.sampling import SamplingParams
    from worker.executor import InprocExecutor

    worker = WorkerConfig(model=folder, dtype=dtype, block_size=64, num_kv_blocks=256, max_model_len=1024)
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    if not native:
        core.executor.runner.model.native_layers = None  # type: ignore[attr-defined]
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0.0, max_tokens=900, ignore_eos=True
    )  # Llama's outlast every family's turn
    for i in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(100)]
        core.add_request(
            AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params, arrival_time=0)
        )
    for _ in range(8):  # the prefill, then warm decode steps
        core.step()
    return core


def timed(core: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return times


def compare(family: Any, llama: Any, steps: int, rounds: int = 3) -> tuple[float, float]:
    """Median step times of the two engines, their steps taken in turn (this VM's speed drifts over
    minutes: the steps compared lie seconds apart)."""
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        ours += timed(family, steps)
        theirs += timed(llama, steps)
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="*", default=[n for n in FAMILIES if n not in MOE_FAMILIES])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/family_steps.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        build("llama", f"{root}/llama")
        variants = [("llama, Python layers", "llama", False)] + [
            (n, n, True) for n in args.families if n != "llama"
        ]
        for label, name, native in variants:
            folder = f"{root}/{name.split()[0]}"
            if not pathlib.Path(folder).exists():
                build(name, folder)
            row: dict[str, Any] = {"family": label}
            for batch in (1, 16):
                core = engine(folder, args.dtype, batch, args.steps, native)
                # a fresh Llama beside each family: its contexts as long as the family's at every step
                llama_core = engine(f"{root}/llama", args.dtype, batch, args.steps)
                row["native_stack"] = core.executor.runner.model.native_layers is not None
                mine, llama = compare(core, llama_core, args.steps)
                core.shutdown()
                llama_core.shutdown()
                row[f"c{batch}_ms"], row[f"c{batch}_llama_ms"] = 1000 * mine, 1000 * llama
            rows.append(row)
            print(f"{label:24s} c=1 {row['c1_ms']:6.1f} ms vs llama {row['c1_llama_ms']:6.1f} "
                  f"({row['c1_ms'] / row['c1_llama_ms']:.2f}x)   c=16 {row['c16_ms']:6.1f} ms vs llama "
                  f"{row['c16_llama_ms']:6.1f} ({row['c16_ms'] / row['c16_llama_ms']:.2f}x)   "
                  f"{'csrc stack' if row['native_stack'] else 'Python layers'}", flush=True)  # fmt: skip
    pathlib.Path(args.out).write_text(
        json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
