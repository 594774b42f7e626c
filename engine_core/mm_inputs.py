"""A vision-language request's images, checked against its prompt before it is queued.

The frontend computes the spans with the model's processor; the engine trusts no span it has not checked:
each lies inside the prompt, after the one before it, and holds exactly its image's placeholder tokens, and
no placeholder token stands outside every span (where no embedding would replace it).
"""

from __future__ import annotations

from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest, ModelInfo


def check_mm_inputs(message: AddRequest, info: ModelInfo) -> None:
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
