"""A vision-language model's own processor (transformers'), its images as the engine takes them, the
placeholder spans of a rendered prompt, and a cache of processed images.

An image is processed alone by the model's processor with the image token as its text, so that both its
arrays (the family's resize, crop, tiling and normalization: transformers' pixels) and the text it stands
for in a prompt (its replacement: LLaVA's image token repeated; Idefics3's tiles each framed by its row and
column tokens) are the processor's own. It is keyed by its bytes' SHA-256 or the caller's `uuid`; the key is
also its content hash, which keeps the KV blocks of another image apart. The rendered prompt holds one image
token per image where the chat template put it; each is replaced by its image's replacement tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.media import MultiModalInput, TensorData

GIB = 1 << 30


# a processor's outputs that are the text's, not the image's
TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass(frozen=True)
class ProcessedImage:
    tensors: dict[str, TensorData]
    token_ids: list[int]  # what the image's token stands for in the prompt (its placeholders among them)
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
    def __init__(self, processor: Any, image_token_id: int, cache_bytes: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.image_token = processor.tokenizer.convert_ids_to_tokens(image_token_id)
        self.cache = ProcessorCache(cache_bytes)

    @classmethod
    def load(cls, folder: str, image_token_id: int, cache_gb: float) -> VisionModel:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call]
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(f"{folder} has no image processor (preprocessor_config.json)")
        return cls(processor, image_token_id, int(cache_gb * GIB))

    def process(self, image: Any, key: str) -> ProcessedImage:
        """One PIL image through the model's processor: its arrays and its replacement tokens."""
        out = self.processor(images=[image], text=[self.image_token], return_tensors="np",
                             add_special_tokens=False)  # fmt: skip
        tensors = {}
        for name, value in out.items():
            if name in TEXT_OUTPUTS:
                continue
            array = np.ascontiguousarray(value)
            if array.dtype == np.float64:
                array = array.astype(np.float32)
            tensors[name] = TensorData(array.tobytes(), list(array.shape), str(array.dtype))
        token_ids = [int(t) for t in out["input_ids"][0]]
        processed = ProcessedImage(tensors, token_ids, token_ids.count(self.image_token_id), key)
        self.cache.put(key, processed)
        return processed

    def expand(
        self, token_ids: list[int], images: list[ProcessedImage]
    ) -> tuple[list[int], list[MultiModalInput]]:
        """The rendered prompt's image tokens, one per image in order, each replaced by its image's tokens;
        ValueError when the template placed another number of them."""
        token = self.image_token_id
        places = [i for i, t in enumerate(token_ids) if t == token]
        if len(places) != len(images):
            raise ValueError(
                f"the prompt holds {len(places)} image placeholders for {len(images)} images (the chat template "
                "places one per image part; an image token typed in the text is not one)"
            )
        ids: list[int] = []
        items = []
        last = 0
        for place, image in zip(places, images, strict=True):
            ids += token_ids[last:place]
            items.append(MultiModalInput("image", image.tensors, image.content_hash, len(ids),
                                         len(image.token_ids), image.num_embeds))  # fmt: skip
            ids += image.token_ids
            last = place + 1
        return ids + token_ids[last:], items
