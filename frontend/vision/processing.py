"""A vision-language model's own processor (transformers'), its images as the engine takes them, the
placeholder spans of a rendered prompt, and a cache of processed images.

An image is processed alone by the model's processor with the image token as its text, so that both its
arrays (the family's resize, crop, tiling and normalization: transformers' pixels) and the text it stands
for in a prompt (its replacement: LLaVA's image token repeated; Idefics3's tiles each framed by its row and
column tokens; Gemma 3's soft tokens between its image markers and blank lines) are the processor's own. It
is keyed by its bytes' SHA-256 or the caller's `uuid`; the key is also its content hash, which keeps the KV
blocks of another image apart.

The rendered prompt holds the image token once per image where the chat template put it; each is replaced
by its image's text and the whole is tokenized, as the processor does (so that a replacement's blank lines
merge with the text beside them as they do there), and each image's span runs from its first placeholder
token to its last.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.media import MultiModalInput, TensorData

GIB = 1 << 30


# a processor's outputs that are the text's, not the image's
TEXT_OUTPUTS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "text_replacement_offsets"}
)


@dataclass(frozen=True)
class ProcessedImage:
    tensors: dict[str, TensorData]
    replacement: str  # the text the image's token stands for in a prompt (its placeholder tokens among it)
    num_embeds: int  # its placeholder tokens: the embeddings the model makes of it
    content_hash: str

    @property
    def nbytes(self) -> int:
        return sum(len(t.data) for t in self.tensors.values())


class ProcessorCache:
    """Processed images by key, least recently used evicted past `max_bytes` (0: no cache); queries and hits
    counted for /metrics. Shared by the request threads of one API server."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, ProcessedImage] = OrderedDict()
        self.nbytes = 0
        self.queries = 0
        self.hits = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> ProcessedImage | None:
        with self._lock:
            self.queries += 1
            item = self.items.get(key)
            if item is not None:
                self.hits += 1
                self.items.move_to_end(key)
            return item

    def put(self, key: str, item: ProcessedImage) -> None:
        if item.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self.items:
                return
            self.items[key] = item
            self.nbytes += item.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self.items.popitem(last=False)
                self.nbytes -= old.nbytes

    def reset(self) -> None:
        with self._lock:
            self.items.clear()
            self.nbytes = 0


class VisionModel:
    def __init__(self, processor: Any, placeholder_id: int, cache_bytes: int) -> None:
        self.processor = processor
        self.placeholder_id = placeholder_id  # the model's image token: each takes one embedding
        # what the chat template places for an image (Gemma 3: its start-of-image token)
        self.image_token = getattr(
            processor, "image_token", None
        ) or processor.tokenizer.convert_ids_to_tokens(placeholder_id)
        self.cache = ProcessorCache(cache_bytes)

    @classmethod
    def load(cls, folder: str, placeholder_id: int, cache_gb: float) -> VisionModel:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call]
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(f"{folder} has no image processor (preprocessor_config.json)")
        return cls(processor, placeholder_id, int(cache_gb * GIB))

    def process(self, image: Any, key: str) -> ProcessedImage:
        """One PIL image through the model's processor: its arrays and its replacement text."""
        out = self.processor(images=[image], text=[self.image_token], return_tensors="np",
                             add_special_tokens=False, return_text_replacement_offsets=True)  # fmt: skip
        tensors = {}
        for name, value in out.items():
            if name in TEXT_OUTPUTS:
                continue
            array = np.ascontiguousarray(value)
            if array.dtype == np.float64:
                array = array.astype(np.float32)
            tensors[name] = TensorData(array.tobytes(), list(array.shape), str(array.dtype))
        replacement = out["text_replacement_offsets"][0][0]["replacement"]
        num_embeds = int(np.count_nonzero(out["input_ids"][0] == self.placeholder_id))
        processed = ProcessedImage(tensors, replacement, num_embeds, key)
        self.cache.put(key, processed)
        return processed

    def prompt(
        self, text: str, images: list[ProcessedImage], tokenize: Callable[[str], list[int]]
    ) -> tuple[list[int], list[MultiModalInput]]:
        """The rendered prompt's image tokens, one per image in order, each replaced by its image's text;
        the whole tokenized; each image's span. ValueError when the template placed another number of
        them, or the text holds a placeholder token of its own."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the prompt holds {len(pieces) - 1} image placeholders for {len(images)} images (the chat "
                "template places one per image part; an image token typed in the text is not one)"
            )
        ids = tokenize(
            pieces[0]
            + "".join(image.replacement + piece for image, piece in zip(images, pieces[1:], strict=True))
        )
        places = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(places) != sum(image.num_embeds for image in images):
            raise ValueError(
                f"the prompt holds {len(places)} image placeholder tokens for {len(images)} images' "
                f"{sum(image.num_embeds for image in images)} embeddings (an image token typed in the text is "
                "not one)"
            )
        items, at = [], 0
        for image in images:
            first, last = places[at], places[at + image.num_embeds - 1]
            items.append(MultiModalInput("image", image.tensors, image.content_hash, first, last + 1 - first,
                                         image.num_embeds))  # fmt: skip
            at += image.num_embeds
        return ids, items
