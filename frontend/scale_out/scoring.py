"""POST /generative_scoring (vLLM's): how likely a generative model finds each label token right after a
query and an item. For each item, one step over the query followed by the item (or the item first), whose
logprobs are exactly the label tokens' (SamplingParams.logprob_token_ids, taken from the raw logits); an
item's score is its first label's probability, over the label tokens alone (apply_softmax) or over the
whole vocabulary."""

from __future__ import annotations

import math
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from frontend.engine.async_llm import final_state, gather_all
from frontend.openai.common import Serving, json_response, until_disconnected
from frontend.openai.format import usage
from frontend.server.errors import OpenAIError
from protocol.sampling import MAX_LOGPROB_TOKEN_IDS, SamplingParams

router = APIRouter()


class GenerativeScoringRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    request_id: str | None = None


@router.post("/generative_scoring")
async def generative_scoring(body: GenerativeScoringRequest, request: Request, serving: Serving) -> Response:
    serving.admit()
    serving.check_priority(body.priority)
    await serving.check_model(body.model)
    model = serving.model_name(body.model)
    vocab_size, limit = serving.model_info.vocab_size, serving.model_info.max_model_len
    labels = body.label_token_ids
    if not 0 < len(labels) <= MAX_LOGPROB_TOKEN_IDS:
        raise OpenAIError(
            f"label_token_ids must have 1 to {MAX_LOGPROB_TOKEN_IDS} token ids.", param="label_token_ids"
        )
    if bad := [t for t in labels if not 0 <= t < vocab_size]:
        raise OpenAIError(
            f"label_token_ids {bad} are out of the vocabulary [0, {vocab_size}).", param="label_token_ids"
        )
    if not body.items:
        raise OpenAIError("items must hold at least one item.", param="items")
    query = ids_of(serving, body.query, body.add_special_tokens, "query", vocab_size)
    prompts = []
    items: list[str | list[int]] = list(body.items)
    for index, item in enumerate(items):
        item_ids = ids_of(serving, item, False, f"items[{index}]", vocab_size)  # no second BOS, as vLLM
        prompt = item_ids + query if body.item_first else query + item_ids
        prompts.append(prompt[: limit - 1])  # vLLM's: room for the one step
    params = SamplingParams(max_tokens=1, logprobs=len(labels), logprob_token_ids=labels)
    request_id = (
        f"generative-scoring-{request.headers.get('x-request-id') or body.request_id or uuid.uuid4().hex}"
    )
    work = [
        final_state(serving.llm.generate(f"{request_id}-{i}", prompt, params, priority=body.priority,
                                         cache_salt=body.cache_salt, lora_name=serving.lora_name(body.model)))
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    states = await until_disconnected(request, gather_all(work))
    data = []
    for index, state in enumerate(states):
        logprobs = state.choices[0].logprobs
        assert logprobs is not None and logprobs.logprobs
        label_logprobs = logprobs.logprobs[0][1:]  # the sampled token's first, then the labels'
        data.append({"index": index, "object": "score", "score": score(label_logprobs, body.apply_softmax)})
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(state.num_output_tokens for state in states)
    cached = sum(state.num_cached_tokens for state in states)
    return json_response({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                          "data": data, "usage": usage(prompt_tokens, completion_tokens, cached)})  # fmt: skip


def ids_of(
    serving: Serving, value: str | list[int], add_special_tokens: bool, param: str, vocab_size: int
) -> list[int]:
    if isinstance(value, str):
        tokenizer = serving.require_tokenizer(param)
        return list(tokenizer(value, add_special_tokens=add_special_tokens)["input_ids"])
    if any(not 0 <= t < vocab_size for t in value):
        raise OpenAIError(f"token ids must be in [0, {vocab_size}).", param=param)
    return list(value)


def score(label_logprobs: list[float], apply_softmax: bool) -> float:
    """The first label's probability: over the labels alone (a softmax of their logprobs), or the model's."""
    if not apply_softmax:
        return math.exp(label_logprobs[0])
    top = max(label_logprobs)
    weights = [math.exp(value - top) for value in label_logprobs]
    return weights[0] / sum(weights)
