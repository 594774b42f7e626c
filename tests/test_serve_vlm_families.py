"""Images through `engine serve` on tiny random checkpoints of the families past LLaVA (tests/test_serve_vision.py):
Idefics3 (SmolVLM's shape: each image cut into tiles framed by row and column tokens) and Gemma 3 (soft tokens
between image markers and blank lines, seeing each other both ways), each saved with its transformers
processor's files. Greedy tokens equal HF transformers' generate over the processor's own prompt and pixels,
through the openai SDK (chat and Responses) and the anthropic SDK, with PNG and JPEG images as data URLs and
from a loopback HTTP server; /tokenize counts what the engine computes."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import httpx
import pytest

from structured_outputs.tokenizer import load_tokenizer
from tests.image_server import image_server
from tests.serve_helpers import serving
from tests.vlm_models import build_gemma3_folder, build_idefics3_folder, png_bytes

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
WIDE, TALL = (
    png_bytes(5, (120, 40)),
    png_bytes(6, (50, 90), "JPEG"),
)  # 2 x 1 tiles and 1 x 2, each and the whole


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


BUILDERS = {"idefics3": build_idefics3_folder, "gemma3": build_gemma3_folder}


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoProcessor

    folder = str(tmp_path_factory.mktemp(request.param))
    tokenizer = load_tokenizer(smollm2_gguf, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    model = BUILDERS[request.param](folder, tokenizer)
    files = {"/tall.jpg": ("image/jpeg", TALL)}
    flags = ["--dtype", "float32", "--max-model-len", "512", "--served-model-name", "smolvlm"]
    with image_server(files) as images, serving(folder, *flags) as server:
        yield server, images, AutoProcessor.from_pretrained(folder), model


def oracle(family, pictures: list[bytes], text: str) -> list[int]:  # type: ignore[no-untyped-def]
    import torch
    from PIL import Image

    _, _, processor, model = family
    content = [*({"type": "image"} for _ in pictures), {"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in pictures]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()  # type: ignore[no-any-return]


def test_every_door_equals_transformers(family) -> None:  # type: ignore[no-untyped-def]
    from anthropic import Anthropic
    from openai import OpenAI

    server, images, processor, _ = family
    client = OpenAI(base_url=f"{server.base}/v1", api_key="none")
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(WIDE)}},
        {"type": "image_url", "image_url": {"url": f"{images}/tall.jpg"}},
        {"type": "text", "text": "Compare them."},
    ]
    answer = client.chat.completions.create(
        model="smolvlm", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,  # type: ignore[misc]
        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert answer.choices[0].token_ids == oracle(family, [WIDE, TALL], "Compare them.")  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": content}]  # /tokenize counts the tiles' tokens as the engine does
    tokens = httpx.post(
        f"{server.base}/tokenize", json={"model": "smolvlm", "messages": messages}, timeout=30
    )
    assert tokens.json()["count"] == answer.usage.prompt_tokens  # type: ignore[union-attr]

    expected = processor.tokenizer.decode(oracle(family, [WIDE], "Describe it."), skip_special_tokens=True)
    response = client.responses.create(
        model="smolvlm", max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(WIDE), "detail": "auto"},
                                            {"type": "input_text", "text": "Describe it."}]}],
    )  # fmt: skip
    assert response.output_text == expected
    message = Anthropic(base_url=server.base, api_key="none").messages.create(
        model="smolvlm", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(WIDE).decode()}},
            {"type": "text", "text": "Describe it."}]}],
    )  # fmt: skip
    assert message.content[0].text == expected  # type: ignore[union-attr]
