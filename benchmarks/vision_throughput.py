"""Image chat throughput: 16 concurrent chat requests, one 448x448 image each, through `engine serve`'s
/v1/chat/completions (the openai SDK, images as PNG data URLs), against transformers'
LlavaForConditionalGeneration.generate over the same images and prompts batched 16, on the same machine and
dtype, in one invocation.

    python -m benchmarks.vision_throughput [--dtype float32] [--rounds 2] [--requests 16] [--max-tokens 32]

The checkpoint is LLaVA-shaped, about 150M parameters, random weights, built once under
~/.cache/engine/vision (a CLIP-B/14 tower at 448x448: 1,024 patches, features of its 11th layer; a 2-product
projector; an 8-layer Llama of width 576 on SmolLM2's tokenizer), with LlavaProcessor's files. Both sides
generate exactly --max-tokens tokens (ignore_eos / min_new_tokens). Each round sends new pictures (one sent
again would hit the server's prefix cache, image and all); rounds take turns (server, then oracle);
the figures are medians. Prints requests/s for each and the ratio; writes JSON to
benchmarks/results/vision_throughput.json.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import statistics
import time

from benchmarks.embeddings_throughput import cpu_name

IMAGE_SIZE = 448
PROMPT = "Describe the picture in one sentence."


def build_checkpoint(folder: str) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from structured_outputs.tokenizer import load_tokenizer
    from tests.conftest import smollm2_path
    from tests.vlm_models import LLAVA_TEMPLATE

    tokenizer = load_tokenizer(smollm2_path(), os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = LLAVA_TEMPLATE
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=IMAGE_SIZE, patch_size=14, projection_dim=512)  # fmt: skip
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                         image_seq_length=(IMAGE_SIZE // 14) ** 2, tie_word_embeddings=True)  # fmt: skip
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1).save_pretrained(folder)  # fmt: skip
    print(f"built {folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def pictures(count: int, first: int) -> list[bytes]:
    """count pictures not sent before (a picture sent again would hit the server's prefix cache)."""
    from tests.vlm_models import png_bytes

    return [png_bytes(first + i, (IMAGE_SIZE, IMAGE_SIZE)) for i in range(count)]


def run_ours(base: str, images: list[bytes], max_tokens: int) -> tuple[float, list[list[int]]]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)

    def one(data: bytes) -> list[int]:
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
        answer = client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,  # type: ignore[misc]
            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(answer.choices[0].token_ids)  # type: ignore[attr-defined]

    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        start = time.perf_counter()
        outputs = list(pool.map(one, images))
        return time.perf_counter() - start, outputs


def run_oracle(model, processor, images: list[bytes], max_tokens: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    import io

    import torch
    from PIL import Image

    start = time.perf_counter()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pils = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = processor(text=[prompt] * len(pils), images=pils, return_tensors="pt", padding=True)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    width = inputs["input_ids"].shape[1]
    return time.perf_counter() - start, [row[width:].tolist() for row in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--serve-defaults", action="store_true",
        help="serve with `engine serve`'s latency defaults (256-token steps, 64 prefill tokens beside decodes) "
        "instead of throughput settings (2,048-token steps, no prefill cap), which transformers' one batch is",
    )  # fmt: skip
    args = parser.parse_args()
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from tests.serve_helpers import serving  # the suite's launcher: a free port, /health, a clean stop

    folder = os.path.join(os.path.expanduser("~"), ".cache", "engine", "vision", "llava-150m")
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        build_checkpoint(folder)
    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    oracle = LlavaForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    run_oracle(oracle, processor, pictures(2, 0), 2)  # warm-up
    ours_s, oracle_s = [], []
    agree = 0
    flags = ["--dtype", args.dtype, "--served-model-name", "llava", "--max-model-len", "2048"]
    if not args.serve_defaults:
        flags += ["--max-num-batched-tokens", "2048", "--decode-prefill-token-budget", "0"]
    with serving(folder, *flags) as served:
        run_ours(served.base, pictures(2, 0), 2)  # warm-up
        for round_ in range(args.rounds):
            images = pictures(args.requests, 100 * (round_ + 1))  # new ones each round, for both sides
            seconds, outputs = run_ours(served.base, images, args.max_tokens)
            ours_s.append(seconds)
            seconds, expected = run_oracle(oracle, processor, images, args.max_tokens)
            oracle_s.append(seconds)
            agree = sum(a == b for a, b in zip(outputs, expected, strict=True))
    ours_rps = args.requests / statistics.median(ours_s)
    oracle_rps = args.requests / statistics.median(oracle_s)
    result = {
        "cpu": cpu_name(), "dtype": args.dtype, "requests": args.requests, "image_size": IMAGE_SIZE,
        "max_tokens": args.max_tokens, "ours_requests_per_s": ours_rps, "oracle_requests_per_s": oracle_rps,
        "ratio": ours_rps / oracle_rps, "ours_seconds": ours_s, "oracle_seconds": oracle_s,
        "outputs_equal": f"{agree}/{args.requests}", "threads": torch.get_num_threads(), "serve_flags": flags,
    }  # fmt: skip
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/vision_throughput.json", "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{cpu_name()}, {args.dtype}: ours {ours_rps:.2f} req/s, transformers generate (batch {args.requests}) "
        f"{oracle_rps:.2f} req/s: {ours_rps / oracle_rps:.2f}x; outputs equal {agree}/{args.requests}"
    )


if __name__ == "__main__":
    main()
