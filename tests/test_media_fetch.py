"""Fetching and decoding images (frontend/vision/fetch.py, decode.py) against a loopback server: the allow-list
checked at every redirect, redirects off, the byte bound while reading, file:// rules, data URLs, and the
pixel bound read from the header; vLLM's environment variables read as vLLM reads them."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest

from frontend.vision.decode import decode_image, max_pixels_from_env
from frontend.vision.fetch import FetchLimits, MediaError, MediaFetcher
from frontend.vision.limits import parse_mm_limits
from tests.image_server import image_server
from tests.vlm_models import png_bytes

PNG = png_bytes(0)


def fetch(limits: FetchLimits, url: str) -> bytes:
    async def run() -> bytes:
        fetcher = MediaFetcher(limits)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def images():  # type: ignore[no-untyped-def]
    with image_server({"/a.png": ("image/png", PNG)}) as base:
        yield base


def test_http_redirects_and_the_allow_list(images: str) -> None:
    assert fetch(FetchLimits(), f"{images}/a.png") == PNG
    assert fetch(FetchLimits(), f"{images}/redirect/a.png") == PNG
    with pytest.raises(MediaError, match="VLLM_MEDIA_URL_ALLOW_REDIRECTS=0"):
        fetch(FetchLimits(allow_redirects=False), f"{images}/redirect/a.png")
    with pytest.raises(MediaError, match=r"allowed domains: \['example.com'\]. Input URL domain: 127.0.0.1"):
        fetch(FetchLimits(allowed_domains=("example.com",)), f"{images}/a.png")
    assert fetch(FetchLimits(allowed_domains=("127.0.0.1",)), f"{images}/a.png") == PNG
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        fetch(FetchLimits(max_bytes=100), f"{images}/a.png")
    with pytest.raises(MediaError, match="HTTP 404"):
        fetch(FetchLimits(), f"{images}/nothing.png")
    with pytest.raises(MediaError, match="timed out"):
        fetch(FetchLimits(timeout_s=0.3, max_tries=2), f"{images}/slow")


def test_a_redirect_to_another_host_is_checked_again() -> None:
    with image_server({"/a.png": ("image/png", PNG)}) as target:
        port = target.rsplit(":", 1)[1]
        with image_server({}) as first:
            # the first server redirects /redirect/PATH to PATH on itself; send it to `localhost` instead
            url = f"{first}/redirect/http://localhost:{port}/a.png"
            limits = FetchLimits(allowed_domains=("127.0.0.1",))
            with pytest.raises(MediaError, match="Input URL domain: localhost"):
                fetch(limits, url)


def test_data_and_file_urls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert fetch(FetchLimits(), data) == PNG
    with pytest.raises(MediaError, match="is not an image"):
        fetch(FetchLimits(), "data:text/plain;base64,aGk=")
    with pytest.raises(MediaError, match="Only base64 data URLs"):
        fetch(FetchLimits(), "data:image/png,abc")
    with pytest.raises(MediaError, match="not valid base64"):
        fetch(FetchLimits(), "data:image/png;base64,@@@")
    with pytest.raises(MediaError, match="HTTP, data or file URL"):
        fetch(FetchLimits(), "ftp://example.com/a.png")
    (tmp_path / "a.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="without `--allowed-local-media-path`"):
        fetch(FetchLimits(), f"file://{tmp_path}/a.png")
    limits = FetchLimits(allowed_local_path=str(tmp_path))
    assert fetch(limits, f"file://{tmp_path}/a.png") == PNG
    with pytest.raises(MediaError, match="must be a subpath"):
        fetch(limits, f"file://{tmp_path}/../a.png")


def test_the_environment_and_the_pixel_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"VLLM_IMAGE_FETCH_TIMEOUT": "2", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
           "VLLM_MEDIA_FETCH_MAX_RETRIES": "0", "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "1"}  # fmt: skip
    limits = FetchLimits.from_env(env, ["a.example"], str(tmp_path))
    assert (limits.timeout_s, limits.allow_redirects, limits.max_tries, limits.max_bytes) == (
        2,
        False,
        1,
        1 << 20,
    )
    assert limits.allowed_domains == ("a.example",) and limits.allowed_local_path == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="not a directory"):
        FetchLimits.from_env({}, [], str(tmp_path / "missing"))
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (300, 200)).save(out, format="PNG")
    assert decode_image(out.getvalue(), 60_000).size == (300, 200)
    with pytest.raises(MediaError, match="decompression bomb"):
        decode_image(out.getvalue(), max_pixels_from_env({"VLLM_MAX_IMAGE_PIXELS": "59999"}))
    with pytest.raises(MediaError, match="not an image"):
        decode_image(b"GIF89a but not really", 10**6)


def test_limit_mm_per_prompt_takes_vllms_json_and_nothing_it_would_ignore() -> None:
    assert parse_mm_limits('{"image": 2}') == {"image": 2}
    assert parse_mm_limits('{"image": {"count": 3}, "video": 0}') == {"image": 3, "video": 0}
    for text, message in [
        ('{"image": {"count": 2, "width": 512}}', "width not supported"),
        ('{"video": 1}', "images only"),
        ('{"image": -1}', "non-negative"),
        ('{"pictures": 1}', "unknown modality"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_mm_limits(text)
