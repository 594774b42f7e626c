"""Images through the doors of `engine serve` on a tiny random LLaVA (its processor files saved as
transformers saves them): greedy tokens equal HF transformers' generate over the processor's own pixels, for
PNG and JPEG images sent as data URLs, from a loopback HTTP server (a redirect included) and as file:// URLs,
through the openai SDK (chat, streamed and not, and Responses), the anthropic SDK and curl; the prefix cache
keys blocks by image; every bad image is a 400 naming the part, and the server goes on."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from typing import Any

import httpx
import pytest

from structured_outputs.tokenizer import load_tokenizer
from tests.image_server import image_server
from tests.serve_helpers import SHARED_API_KEY, serving
from tests.vlm_models import build_llava_folder, png_bytes

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LIMIT_IMAGES = 2


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava(smollm2_gguf: str, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    folder = str(tmp_path_factory.mktemp("llava"))
    build_llava_folder(
        folder, load_tokenizer(smollm2_gguf, os.path.join(os.path.expanduser("~"), ".cache", "engine"))
    )
    return (
        folder,
        AutoProcessor.from_pretrained(folder),
        LlavaForConditionalGeneration.from_pretrained(folder).eval(),
    )


def oracle(llava, images: list[bytes], text: str) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers: the template with one image part per image, then the processor, then generate."""
    import torch
    from PIL import Image

    _, processor, model = llava
    messages = [
        {"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}
    ]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = processor(text=prompt, images=pictures or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()  # type: ignore[no-any-return]


PNG, JPEG, OTHER = png_bytes(0), png_bytes(1, (120, 90), "JPEG"), png_bytes(2, (64, 64))


def flat_png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


BOMB = flat_png((1200, 1000))  # a few KB that decode to 1.2 M pixels: past the server's VLLM_MAX_IMAGE_PIXELS
BIG = png_bytes(4, (400, 300))  # ~360 KB of noise: past its VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB below


@pytest.fixture(scope="module")
def served(llava, tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = llava[0]
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(PNG)
    files = {"/a.png": ("image/png", PNG), "/b.jpg": ("image/jpeg", JPEG), "/big.png": ("image/png", BIG),
             "/bomb.png": ("image/png", BOMB), "/text.txt": ("text/plain", b"not an image")}  # fmt: skip
    env = {"VLLM_IMAGE_FETCH_TIMEOUT": "1", "VLLM_MEDIA_FETCH_MAX_RETRIES": "1",
           "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "0.2", "VLLM_MAX_IMAGE_PIXELS": "1000000",
           "ENGINE_SERVER_DEV_MODE": "1"}  # fmt: skip
    flags = ["--dtype", "float32", "--max-model-len", "256", "--allowed-local-media-path", str(media),
             "--limit-mm-per-prompt", json.dumps({"image": LIMIT_IMAGES}), "--served-model-name", "llava"]  # fmt: skip
    with image_server(files) as images, serving(folder, *flags, env=env) as server:
        yield server, images, media


def chat(server, content: list[dict[str, Any]], **extra: Any) -> httpx.Response:  # type: ignore[no-untyped-def]
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)


def test_chat_equals_transformers_through_the_openai_sdk(llava, served) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    server, images, _ = served
    client = OpenAI(base_url=f"{server.base}/v1", api_key="none")
    cases = [
        ([data_url(PNG)], [PNG]),
        ([f"{images}/b.jpg"], [JPEG]),
        ([f"{images}/redirect/a.png", data_url(OTHER)], [PNG, OTHER]),  # two images, one behind a redirect
    ]
    for urls, pictures in cases:
        expected = oracle(llava, pictures, "What is in the picture?")
        content = [*(image_part(url) for url in urls), {"type": "text", "text": "What is in the picture?"}]
        answer = client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,  # type: ignore[misc]
            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert answer.choices[0].token_ids == expected, urls  # type: ignore[attr-defined]
        stream = client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,  # type: ignore[misc]
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == answer.choices[0].message.content


def test_responses_messages_and_curl_doors(llava, served) -> None:  # type: ignore[no-untyped-def]
    from anthropic import Anthropic
    from openai import OpenAI

    server, _, media = served
    tokenizer = llava[1].tokenizer
    expected = tokenizer.decode(oracle(llava, [PNG], "Describe it."), skip_special_tokens=True)
    client = OpenAI(base_url=f"{server.base}/v1", api_key="none")
    response = client.responses.create(
        model="llava", max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                                            {"type": "input_text", "text": "Describe it."}]}],
    )  # fmt: skip
    assert response.output_text == expected
    anthropic = Anthropic(base_url=server.base, api_key="none")
    message = anthropic.messages.create(
        model="llava", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}},
            {"type": "text", "text": "Describe it."}]}],
    )  # fmt: skip
    assert message.content[0].text == expected  # type: ignore[union-attr]
    body = {"model": "llava", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [image_part(f"file://{media}/cat.png"),
                                                      {"type": "text", "text": "Describe it."}]}]}  # fmt: skip
    out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", json.dumps(body),
                          f"{server.base}/v1/chat/completions"], capture_output=True, timeout=60, check=True)  # fmt: skip
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == expected


def test_the_prefix_cache_keys_blocks_by_image(served) -> None:  # type: ignore[no-untyped-def]
    server = served[0]
    text = {"type": "text", "text": "What is it? " * 24}  # past one block of 64 tokens
    first = chat(server, [image_part(data_url(OTHER)), text]).json()
    again = chat(server, [image_part(data_url(OTHER)), text]).json()
    other = chat(server, [image_part(data_url(PNG)), text]).json()
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert (other["usage"]["prompt_tokens_details"] or {}).get(
        "cached_tokens", 0
    ) == 0  # its first block differs


def test_bad_images_are_400s_naming_the_part(served) -> None:  # type: ignore[no-untyped-def]
    server, images, media = served
    text = {"type": "text", "text": "hi"}
    cases = {
        "not an image": [image_part(data_url(b"hello there")), text],
        "is not an image": [image_part("data:text/plain;base64,aGk="), text],
        "HTTP 404": [image_part(f"{images}/missing.png"), text],
        "timed out": [image_part(f"{images}/slow"), text],
        "larger than": [image_part(f"{images}/big.png"), text],
        "decompression bomb": [image_part(f"{images}/bomb.png"), text],
        "At most 2 image(s)": [image_part(data_url(PNG))] * 3 + [text],
        "must be a subpath": [image_part("file:///etc/hostname"), text],
        "Unsupported chat content part type": [{"type": "input_audio", "input_audio": {}}, text],
        "no image is cached under uuid": [
            {"type": "image_url", "image_url": None, "uuid": "never-sent"},
            text,
        ],
        "image placeholders for 1 images": [
            image_part(data_url(PNG)),
            {"type": "text", "text": "<image> again"},
        ],
    }
    for message, content in cases.items():
        response = chat(server, content)
        assert response.status_code == 400, (message, response.text)
        error = response.json()["error"]
        assert message in error["message"], (message, error)
        assert error["param"] and error["param"].startswith("messages"), error
    assert chat(server, [image_part(data_url(PNG)), text]).status_code == 200  # and the server goes on
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert 'engine:num_requests_running{engine="0",model_name="llava"} 0.0' in metrics


def test_uuid_keys_the_processor_cache_and_reset_empties_it(served) -> None:  # type: ignore[no-untyped-def]
    server = served[0]

    def hits() -> float:
        lines = httpx.get(f"{server.base}/metrics", timeout=10).text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("engine:mm_cache_hits_total"))

    text = {"type": "text", "text": "hi"}
    by_uuid = {"type": "image_url", "image_url": None, "uuid": "cat-1"}
    assert chat(server, [{**image_part(data_url(PNG)), "uuid": "cat-1"}, text]).status_code == 200
    before = hits()
    answer = chat(server, [by_uuid, text])
    assert answer.status_code == 200, answer.text
    assert hits() == before + 1
    assert httpx.post(f"{server.base}/reset_mm_cache", timeout=10).status_code == 200
    assert chat(server, [by_uuid, text]).status_code == 400
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert "engine:encoder_inputs_total" in metrics and "engine:encoder_seconds_total" in metrics
    messages = [{"role": "user", "content": [image_part(data_url(PNG)), text]}]  # /tokenize counts the image
    tokens = httpx.post(
        f"{server.base}/tokenize", json={"model": "llava", "messages": messages}, timeout=30
    ).json()
    assert tokens["count"] == chat(server, messages[0]["content"]).json()["usage"]["prompt_tokens"]


def test_a_text_model_refuses_images(smollm2_server) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": [image_part(data_url(PNG)), {"type": "text", "text": "hi"}]}],
            "max_tokens": 2}  # fmt: skip
    headers = {"Authorization": f"Bearer {SHARED_API_KEY}"}
    response = httpx.post(
        f"{smollm2_server.base}/v1/chat/completions", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 400
    assert "is not a multimodal model" in response.json()["error"]["message"]


def test_offline_chat_and_run_batch_take_images(llava, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LLM.chat with image parts (a file:// URL under allowed_local_media_path), and `engine run-batch`
    lines whose chat bodies hold images, equal transformers."""
    import sys

    from frontend.offline.llm import LLM
    from protocol.sampling import SamplingParams

    folder = llava[0]
    expected = oracle(llava, [JPEG], "Describe it.")
    (tmp_path / "dog.jpg").write_bytes(JPEG)
    content = [image_part(f"file://{tmp_path}/dog.jpg"), {"type": "text", "text": "Describe it."}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(folder, dtype="float32", max_model_len=256, allowed_local_media_path=str(tmp_path)) as llm:
        result = llm.chat([{"role": "user", "content": content}], params)
        assert result[0].outputs[0].token_ids == expected
        with pytest.raises(Exception, match="allowed-local-media-path"):
            llm.chat([{"role": "user", "content": [image_part("file:///etc/hostname")]}], params)
    body = {"model": folder, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [image_part(data_url(JPEG, "image/jpeg")),
                                                      {"type": "text", "text": "Describe it."}]}]}  # fmt: skip
    lines = [{"custom_id": "jpeg", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "messages": [{"role": "user", "content": [image_part("data:image/png;base64,AAAA")]}]}}]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "frontend.cli", "run-batch", folder, "--dtype", "float32", "--max-model-len",
               "256", "-i", str(source), "-o", str(target)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert records["jpeg"]["response"]["body"]["choices"][0]["token_ids"] == expected
    assert records["bad"]["response"]["status_code"] == 400
