"""A step's room for image towers (a vision-language model's images, `Request.mm_inputs`): the step's
encoder budget and the encoder cache's free room, both in embeddings; a prefill chunk cut to stop before the
first image that finds none; the images it runs taken from both.

An image is held (`Request.encoder_held`) from the step that runs its tower until the request's computed
tokens pass its span; the worker keeps its embeddings for as long (worker/mm_inputs.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine_core.config import SchedulerConfig
from engine_core.request import Request


@dataclass
class EncoderRoom:
    budget: int  # the step's encoder embeddings left (SchedulerConfig.max_num_encoder_input_tokens)
    free: int  # the encoder cache's room left (SchedulerConfig.encoder_cache_tokens)


def embeds_of(request: Request, indices: Iterable[int]) -> int:
    return sum(request.mm_inputs[index].num_embeds for index in indices)


def encoder_room(running: list[Request], config: SchedulerConfig) -> EncoderRoom:
    """A step's room, once the images the running requests have computed past are let go."""
    held = 0
    for request in running:
        if request.encoder_held:
            request.release_encoder_outputs()
            held += embeds_of(request, request.encoder_held)
    return EncoderRoom(config.max_num_encoder_input_tokens, config.encoder_cache_tokens - held)


def fit_encoder_inputs(
    request: Request, start: int, num_new: int, room: EncoderRoom, whole_spans: bool = False
) -> tuple[int, list[int]]:
    """The tokens from `start` the step may compute, cut to stop before the first image whose tower finds no
    room (or, with whole_spans, whose span would end past them), and the images whose tower runs for them."""
    if not request.mm_inputs:
        return num_new, []
    if whole_spans:
        num_new = whole_span_chunk(request, start, num_new)
    items: list[int] = []
    budget, free = room.budget, room.free
    for index in request.encoder_items_in(start, num_new):
        item = request.mm_inputs[index]
        if item.num_embeds > min(budget, free):
            return max(item.offset - start, 0), items
        items.append(index)
        budget -= item.num_embeds
        free -= item.num_embeds
    return num_new, items


def whole_span_chunk(request: Request, start: int, num_new: int) -> int:
    """The chunk from `start` cut to end before the first image span it would cut (0 when that span began
    before it: the rest of the span waits for a step with room for all of it)."""
    end = start + num_new
    for item in request.mm_inputs:
        if item.offset < end < item.offset + item.length:
            return max(item.offset - start, 0)
    return num_new


def take_encoder_inputs(
    request: Request, items: list[int], room: EncoderRoom, scheduled: dict[str, list[int]]
) -> None:
    """The request's images run this step: held from now, their embeddings out of the room."""
    if not items:
        return
    num_embeds = embeds_of(request, items)
    room.budget -= num_embeds
    room.free -= num_embeds
    request.encoder_held.update(items)
    scheduled[request.request_id] = items
