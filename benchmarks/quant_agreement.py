"""How often a GGUF file served as its blocks agrees with HF transformers' float32 run of the same file,
beside the same file dequantized (`--quantization none`), on the same chat prompts:

    python -m benchmarks.quant_agreement [--model FILE.gguf] [--tokens 32] [--int8]

For each (quantization, dtype) it prints the greedy tokens that equal HF's before the first difference,
summed over the prompts, and at each first difference HF's gap between its top two logprobs (a near-tie
is where a rounding may legitimately part them). --int8 adds the blocks with `--activation-quantization int8`.
"""

from __future__ import annotations

import argparse

from frontend import LLM, SamplingParams
from tests.hf_oracle import hf_greedy, hf_model_of_gguf
from tests.test_correctness_smollm2 import QUESTIONS

CONFIGS = (("gguf", "float32"), ("none", "float32"), ("gguf", "bfloat16"), ("none", "bfloat16"))


def main(argv: list[str] | None = None) -> dict[str, tuple[int, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--int8", action="store_true", help="also --activation-quantization int8")
    args = parser.parse_args(argv)
    from tests.conftest import smollm2_path

    model = args.model or smollm2_path()
    hf = hf_model_of_gguf(model)
    results: dict[str, tuple[int, list[float]]] = {}
    prompts: list[list[int]] = []
    oracle = []
    configs = [(q, d, None) for q, d in CONFIGS]
    configs += [("gguf", d, "int8") for d in ("float32", "bfloat16")] if args.int8 else []
    for quantization, dtype, rows in configs:
        with LLM(model, dtype=dtype, max_model_len=1024, num_kv_blocks=128, quantization=quantization,
                 activation_quantization=rows) as llm:  # fmt: skip
            outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                               SamplingParams(temperature=0.0, max_tokens=args.tokens))  # fmt: skip
            if not oracle:
                prompts = [o.prompt_token_ids for o in outputs]
                oracle = [hf_greedy(hf, ids, args.tokens, eos_token_id=None) for ids in prompts]
        agreed, gaps = 0, []
        for output, run in zip(outputs, oracle, strict=True):
            ours = output.outputs[0].token_ids
            same = next(
                (i for i, (a, b) in enumerate(zip(ours, run.token_ids, strict=False)) if a != b), None
            )
            agreed += len(ours) if same is None else same
            if same is not None:
                top = run.logprobs[same].topk(2).values
                gaps.append(float(top[0] - top[1]))
        name = f"{quantization}{'+int8' if rows else ''} {dtype}"
        results[name] = (agreed, gaps)
        total = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"--quantization {name:18}: {agreed}/{total} tokens equal HF's before "
              f"the first difference; HF's top-two gaps there: {[round(g, 4) for g in gaps]}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
