"""LLM.chat with images: a conversation's image parts (the chat door's shapes: frontend/vision/parts.py)
loaded as the server loads them (data URLs, http(s), file:// under `allowed_local_media_path`), the
template rendered over content parts, and the image tokens expanded to the images' spans."""

from __future__ import annotations

import os
from typing import Any

from frontend.server.errors import OpenAIError
from frontend.vision.decode import max_pixels_from_env
from frontend.vision.fetch import FetchLimits, MediaFetcher
from frontend.vision.loader import ImageLoader
from frontend.vision.parts import message_images, template_content
from frontend.vision.processing import VisionModel
from protocol.errors import InvalidParameterError
from protocol.media import MultiModalInput
from protocol.messages import ModelInfo


class VisionChat:
    def __init__(self, model: str, info: ModelInfo, allowed_local_media_path: str | None = None) -> None:
        if info.image_token_id < 0:
            raise InvalidParameterError("messages", f"{model} is not a multimodal model")
        vision = VisionModel.load(model, info.image_token_id, 4.0)
        limits = FetchLimits.from_env(os.environ, [], allowed_local_media_path)
        self.loader = ImageLoader(vision, MediaFetcher(limits), max_pixels_from_env(os.environ))

    async def render(
        self, tokenizer: Any, conversation: list[dict[str, Any]], **template: Any
    ) -> tuple[str, list[int], list[MultiModalInput]]:
        """(prompt text, token ids with the images' spans, the images)."""
        try:
            images = await self.loader.load(message_images(conversation))
            messages = [
                {**m, "content": template_content(m["content"] if isinstance(m.get("content"), list)
                                                  else [{"type": "text", "text": m.get("content") or ""}],
                                                  f"messages[{i}].content")}
                for i, m in enumerate(conversation)
            ]  # fmt: skip
            text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
            ids, items = self.loader.model.prompt(
                text, images, lambda prompt: list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            )
        except OpenAIError as error:
            raise InvalidParameterError(error.param or "messages", error.message) from None
        except ValueError as error:
            raise InvalidParameterError("messages", str(error)) from None
        return text, ids, items

    async def close(self) -> None:
        await self.loader.fetcher.close()
