"""A chat message's image parts, in every shape vLLM takes, and the content the chat template sees.

Parts: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`, vLLM's shorthand without a type
(`{"image_url": "https://..."}` or `{"image_url": {"url": ...}}`), and `uuid` beside either: the caller's
cache key for the image (its processed form is looked up by it, not by the image's bytes). `detail` is
taken as vLLM takes it: one of auto, low, high, and it changes nothing (the model's processor decides the
resolution). The template sees each image as `{"type": "image"}` in the message's content list, where
vision-language templates put the model's image token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.server.errors import OpenAIError

DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImagePart:
    url: str | None  # None: a uuid alone, for an image the processor cache holds
    uuid: str | None
    param: str  # where it sits in the request, for errors


def image_of(part: dict[str, Any], param: str) -> ImagePart | None:
    """The image a content part carries, or None for a text part; a 400 for a part of no kind we take."""
    kind = part.get("type")
    if kind is None or "uuid" in part:  # vLLM's shorthand forms
        if "image_url" in part:
            kind = "image_url"
        elif kind is None and "text" in part:
            kind = "text"
        elif kind is None:
            raise OpenAIError("Missing 'type' field in multimodal part.", param=f"{param}.type")
    if not isinstance(kind, str):
        raise OpenAIError("Invalid 'type' field in multimodal part.", param=f"{param}.type")
    if kind == "text":
        return None
    if kind != "image_url":
        raise OpenAIError(
            f"Unsupported chat content part type: {kind!r}. Supported types: text, image_url.",
            param=f"{param}.type",
        )
    value = part.get("image_url")
    url: Any = value.get("url") if isinstance(value, dict) else value
    detail = value.get("detail", "auto") if isinstance(value, dict) else part.get("detail", "auto")
    if detail not in DETAILS:
        raise OpenAIError(
            f"image_url.detail must be one of {', '.join(DETAILS)}.", param=f"{param}.image_url.detail"
        )
    uuid = part.get("uuid")
    if url is None and uuid is None:
        raise OpenAIError("an image_url part needs image_url.url (or a uuid).", param=f"{param}.image_url")
    if url is not None and not isinstance(url, str):
        raise OpenAIError("image_url.url must be a string.", param=f"{param}.image_url.url")
    return ImagePart(url, None if uuid is None else str(uuid), param)


def message_images(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """Every image of the conversation, in order."""
    images = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for number, part in enumerate(content):
            if isinstance(part, dict):
                image = image_of(part, f"messages[{index}].content[{number}]")
                if image is not None:
                    images.append(image)
    return images


def template_content(content: list[Any], param: str) -> list[dict[str, Any]]:
    """A content list as vision-language templates read it: text parts and `{"type": "image"}`."""
    result: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        if not isinstance(part, dict):
            raise OpenAIError("a content part must be an object.", param=param)
        if image_of(part, f"{param}[{number}]") is not None:
            result.append({"type": "image"})
        else:
            result.append({"type": "text", "text": str(part.get("text", ""))})
    return result
