"""A request's images: each part fetched (frontend/vision/fetch.py), decoded and processed off the event loop
(or found in the processor cache), concurrently; the first failure cancels the rest and answers 400 naming
the part. --limit-mm-per-prompt bounds their number, as vLLM's JSON says it."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from frontend.server.errors import OpenAIError
from frontend.vision.decode import decode_image
from frontend.vision.fetch import MediaError, MediaFetcher
from frontend.vision.limits import DEFAULT_LIMIT
from frontend.vision.parts import ImagePart, message_images
from frontend.vision.processing import ProcessedImage, VisionModel


async def chat_images(
    loader: ImageLoader | None, model_name: str, messages: list[Any]
) -> list[ProcessedImage]:
    """The conversation's images, loaded; a 400 when there are images and the model takes none."""
    parts = message_images(messages)
    if not parts:
        return []
    if loader is None:
        raise OpenAIError(f"{model_name} is not a multimodal model", param=parts[0].param)
    return await loader.load(parts)


@dataclass
class ImageLoader:
    model: VisionModel
    fetcher: MediaFetcher
    max_pixels: int
    max_images: int = DEFAULT_LIMIT
    metrics: Any = None  # frontend/metrics.py's Metrics: the processor cache's queries and hits

    async def load(self, parts: list[ImagePart]) -> list[ProcessedImage]:
        if len(parts) > self.max_images:
            raise OpenAIError(
                f"At most {self.max_images} image(s) may be provided in one prompt.",
                param=parts[self.max_images].param,
            )
        if not parts:
            return []
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the other fetches
                tasks = [group.create_task(self._one(part)) for part in parts]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    def _cached(self, key: str) -> ProcessedImage | None:
        hit = self.model.cache.get(key)
        if self.metrics is not None:
            self.metrics.mm_cache_queries.labels(self.metrics.model_name).inc()
            if hit is not None:
                self.metrics.mm_cache_hits.labels(self.metrics.model_name).inc()
        return hit

    async def _one(self, part: ImagePart) -> ProcessedImage:
        key = f"uuid:{part.uuid}" if part.uuid is not None else None
        if key is not None and (hit := self._cached(key)) is not None:
            return hit
        if part.url is None:
            raise OpenAIError(
                f"no image is cached under uuid {part.uuid!r}: send its url too.", param=part.param
            )
        try:
            data = await self.fetcher.fetch(part.url)
            if key is None:
                key = hashlib.sha256(data).hexdigest()
                if (hit := self._cached(key)) is not None:
                    return hit
            image = await asyncio.to_thread(decode_image, data, self.max_pixels)
        except MediaError as error:
            raise OpenAIError(str(error), param=part.param) from None
        return await asyncio.to_thread(self.model.process, image, key)
