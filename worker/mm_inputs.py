"""The worker's side of a vision-language model's images: each request's images (their spans and the prompt
positions of their placeholder tokens), the vision tower run on the images the engine scheduled (each
image's embeddings computed once, whatever the chunks its span is prefilled in), those embeddings placed in
a step's rows, and each freed once the request's computed tokens pass its span (or the request leaves).

The engine plans the same lifetimes (engine_core/scheduler.py: encoder_held), so the two agree on which
images are held without being told."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protocol.media import MultiModalInput, TensorData
from protocol.messages import RequestError
from protocol.worker_messages import NewRequestData, SchedulerOutput
from worker.attention.base import ImageRun
from worker.input_batch import StepInputs
from worker.model_config import ModelConfig, UnsupportedModelError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32, "bool": torch.bool}  # fmt: skip


def to_tensor(data: TensorData) -> torch.Tensor:
    dtype = DTYPES.get(data.dtype)
    if dtype is None:
        raise ValueError(f"an image tensor of dtype {data.dtype!r}")
    tensor = torch.frombuffer(bytearray(data.data), dtype=dtype)
    if tensor.numel() != int(np.prod(data.shape)):
        raise ValueError(f"an image tensor of {tensor.numel()} values for shape {data.shape}")
    return tensor.view(data.shape)


@dataclass
class Image:
    item: MultiModalInput
    positions: np.ndarray  # the prompt positions of its placeholder tokens, ascending
    embeds: torch.Tensor | None = None  # [num_embeds, hidden] while held

    @property
    def end(self) -> int:
        return self.item.offset + self.item.length

    def runs(self) -> list[tuple[int, int]]:
        """[first, end) of each run of consecutive placeholder positions (Gemma 3: one per image or crop)."""
        breaks = np.flatnonzero(np.diff(self.positions) != 1) + 1
        return [(int(run[0]), int(run[-1]) + 1) for run in np.split(self.positions, breaks)]


class ImageInputs:
    def __init__(self, model: Any, image_token_id: int, bidirectional: bool = False) -> None:
        self.model = model  # has encode_image(tensors) and check_image(tensors)
        self.image_token_id = image_token_id
        self.bidirectional = bidirectional  # each run of an image's tokens sees itself both ways
        self.requests: dict[str, list[Image]] = {}
        self.step_inputs = 0  # the last run()'s images and seconds (ModelRunnerOutput's)
        self.step_seconds = 0.0

    @classmethod
    def of(cls, model: Any, config: ModelConfig) -> ImageInputs | None:
        """A vision-language model's (None for any other)."""
        vision = config.vision
        return cls(model, vision.image_token_id, vision.bidirectional) if vision is not None else None

    def step(
        self, scheduler_output: SchedulerOutput, inputs: StepInputs
    ) -> tuple[dict[str, RequestError], tuple[torch.Tensor, torch.Tensor] | None]:
        """The step's towers run, and its placeholder rows' embeddings (the model's mm_embeds)."""
        errors = self.run(scheduler_output.scheduled_encoder_inputs)
        embeds = self.step_embeds(inputs)
        if self.bidirectional and embeds is not None:
            self.mark_runs(inputs)
        self.release(inputs)
        return errors, embeds

    def add(self, new_requests: list[NewRequestData]) -> None:
        for new in new_requests:
            if not new.mm_inputs:
                continue
            prompt = np.asarray(new.prompt_token_ids)
            images = []
            for item in new.mm_inputs:
                span = prompt[item.offset : item.offset + item.length]
                images.append(Image(item, item.offset + np.flatnonzero(span == self.image_token_id)))
            self.requests[new.request_id] = images

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def run(self, scheduled: dict[str, list[int]]) -> dict[str, RequestError]:
        """The tower on each scheduled image, one image a call (its embeddings the same whatever else the
        step holds); a request whose image the model cannot take ends with an error."""
        errors = {}
        start = time.perf_counter()
        self.step_inputs = 0  # the images whose tower runs (a dropped request's run none)
        for request_id, indices in scheduled.items():
            images = self.requests.get(request_id)
            if (
                images is None
            ):  # an image of it failed in the step before (async scheduling): the engine ends it
                continue
            for index in indices:
                image = images[index]
                try:
                    tensors = {name: to_tensor(data) for name, data in image.item.tensors.items()}
                    self.model.check_image(tensors)
                    self.step_inputs += 1
                    embeds = self.model.encode_image(tensors)
                except (ValueError, UnsupportedModelError) as error:
                    errors[request_id] = RequestError("messages", f"image {index}: {error}")
                    break
                if embeds.shape[0] != image.item.num_embeds:
                    errors[request_id] = RequestError(
                        "messages",
                        f"image {index} makes {embeds.shape[0]} embeddings, not {image.item.num_embeds}",
                    )
                    break
                image.embeds = embeds
        for request_id in errors:
            self.drop(request_id)  # its rows run on the placeholders' embeddings; the engine drops them
        self.step_seconds = time.perf_counter() - start if self.step_inputs else 0.0
        return errors

    def step_embeds(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of the step's placeholder positions, for the model's mm_embeds."""
        rows, parts = [], []
        first_row = 0
        for request_id, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
            for image in self.requests.get(request_id, ()):
                lo, hi = np.searchsorted(image.positions, [start, start + count])
                if lo < hi:
                    assert image.embeds is not None, f"{request_id}: an image's span runs before its tower"
                    rows.append(image.positions[lo:hi] - start + first_row)
                    parts.append(image.embeds[lo:hi])
            first_row += int(count)
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)), torch.cat(parts)

    def mark_runs(self, inputs: StepInputs) -> None:
        """The step's runs of image tokens, for the attention of every layer (both pools')."""
        runs, first_row = [], 0
        for request_id, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
            end = int(start + count)
            for image in self.requests.get(request_id, ()):
                for first, last in image.runs():
                    if first < end and last > start:
                        assert last <= end, f"{request_id}: a run of image tokens split across steps"
                        lo = max(first, int(start))
                        runs.append(
                            ImageRun(first_row + lo - int(start), first_row + last - int(start), first, last)
                        )
            first_row += int(count)
        inputs.metadata.image_runs = runs
        if inputs.metadata.window_group is not None:
            inputs.metadata.window_group.image_runs = runs

    def release(self, inputs: StepInputs) -> None:
        """Free the embeddings of the images whose span the step's tokens finished."""
        for request_id, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
            for image in self.requests.get(request_id, ()):
                if image.embeds is not None and image.end <= start + count:
                    image.embeds = None


def check_vision(config: Any, device: str, pooling: bool) -> None:
    """What a vision-language model does not run with yet: each an UnsupportedModelError naming it."""
    refused = [
        ("--device cuda", device != "cpu"),
        ("--tensor-parallel-size > 1", config.parallel.tensor_parallel_size > 1),
        ("a pooling runner", pooling),
    ]
    for flag, applies in refused:
        if applies:
            raise UnsupportedModelError(f"vision-language models do not run with {flag} yet")
