"""A vision-language request's images, checked against its prompt before it is queued.

The frontend computes the spans with the model's processor; the engine trusts no span it has not checked:
each lies inside the prompt, after the one before it, and holds exactly its image's placeholder tokens, and
no placeholder token stands outside every span (where no embedding would replace it). Where a span is
computed in one step (ModelInfo.whole_image_spans), it fits in one.
"""

from __future__ import annotations

from engine_core.config import SchedulerConfig
from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest, ModelInfo


def check_mm_inputs(message: AddRequest, info: ModelInfo, config: SchedulerConfig) -> None:
    items = message.mm_inputs
    image_token = info.image_token_id
    if not items:
        if image_token >= 0 and image_token in message.prompt_token_ids:
            raise InvalidParameterError(
                "messages", "the prompt holds the image placeholder token but no image goes with it."
            )
        return
    if image_token < 0:
        raise InvalidParameterError("messages", "this model takes no images: send text only.")
    prompt = message.prompt_token_ids
    end = 0
    for index, item in enumerate(items):
        if item.modality != "image":
            raise InvalidParameterError("messages", f"this model takes images, not {item.modality!r}.")
        if item.offset < end or item.length < 1 or item.offset + item.length > len(prompt):
            raise InvalidParameterError(
                "messages", f"image {index}'s placeholder span lies outside the prompt or over another's."
            )
        end = item.offset + item.length
        if config.whole_image_spans and item.length > config.max_num_batched_tokens:
            raise InvalidParameterError(
                "messages",
                f"image {index}'s span of {item.length} tokens is computed in one step, and a step computes at "
                f"most {config.max_num_batched_tokens} (--max-num-batched-tokens).",
            )
        count = prompt[item.offset : end].count(image_token)
        if count != item.num_embeds or not 0 < item.num_embeds <= info.max_image_tokens:
            raise InvalidParameterError(
                "messages",
                f"image {index} makes {item.num_embeds} embeddings; its span holds {count} placeholders "
                f"(at most {info.max_image_tokens} an image).",
            )
    if prompt.count(image_token) != sum(item.num_embeds for item in items):
        raise InvalidParameterError(
            "messages", "the prompt holds an image placeholder token outside every image."
        )
