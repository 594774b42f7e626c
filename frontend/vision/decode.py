"""An image's bytes to RGB pixels (Pillow), off the event loop, bounded: the header's size is checked before
a pixel is decoded, so a small file that would expand to gigabytes (a decompression bomb) is refused
cheaply. VLLM_MAX_IMAGE_PIXELS sets the bound (default 178,956,970: Pillow's own bomb threshold)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

from frontend.vision.fetch import MediaError

MAX_IMAGE_PIXELS = 178_956_970


def max_pixels_from_env(environ: Mapping[str, str]) -> int:
    raw = environ.get("VLLM_MAX_IMAGE_PIXELS", "").strip()
    try:
        value = int(raw) if raw else MAX_IMAGE_PIXELS
    except ValueError:
        raise ValueError(f"VLLM_MAX_IMAGE_PIXELS must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError("VLLM_MAX_IMAGE_PIXELS must be positive: an unbounded decode is what it guards")
    return value


def decode_image(data: bytes, max_pixels: int) -> Any:
    """-> a PIL.Image in RGB; MediaError for what is not an image Pillow reads, or one too large."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(
                    f"the image is {width}x{height} = {width * height} pixels, past the limit of {max_pixels} "
                    "(a decompression bomb?)"
                )
            image.load()
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise MediaError(
            "the data is not an image this server can read (PNG, JPEG, WebP, GIF, BMP, ...)"
        ) from None
    except Image.DecompressionBombError as error:
        raise MediaError(str(error)) from None
    except (OSError, SyntaxError, ValueError) as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(f"the image cannot be decoded: {error}") from None
