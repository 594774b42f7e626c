"""What the pooling doors share: inputs (text or token ids) to prompts, checked against the model's
limits; pooling requests run on the engine at once; pooled bytes back to arrays.

Truncation (truncate_prompt_tokens) of a text is the tokenizer's (a BERT tokenizer cuts the end and
keeps [SEP], as sentence-transformers does); of token ids, the last k are kept, as vLLM keeps them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from fastapi import Request

from frontend.engine.async_llm import gather_all, new_request_id
from frontend.openai.common import until_disconnected
from frontend.openai.serving import OpenAIServing
from frontend.pooling.schemas import MAX_INPUTS, Input, PoolingFields
from frontend.server.errors import OpenAIError
from protocol.pooling import PooledOutput, PoolingParams


@dataclass
class PoolingPrompt:
    token_ids: list[int]
    token_type_start: int | None = None  # a pair's second text starts here (cross-encoders)


def check_task(serving: OpenAIServing, task: str, what: str) -> None:
    """404 when the model does not serve the task (vLLM registers such routes only where they are)."""
    info = serving.model_info
    if task not in info.pooling_tasks:
        tasks = ", ".join(info.pooling_tasks) if info.runner == "pooling" else "generate"
        raise OpenAIError(
            f"The model `{info.served_model_names[0]}` does not serve {what}; its tasks: {tasks}.",
            status=404,
            type="NotFoundError",
            param="model",
            code="model_task_not_supported",
        )


def render_inputs(
    serving: OpenAIServing, given: Input, body: PoolingFields, param: str = "input"
) -> list[PoolingPrompt]:
    """`input` as OpenAI's embeddings take it: a string, strings, token ids, or lists of token ids."""
    if isinstance(given, str):
        items: list[Any] = [given]
    elif given and all(isinstance(x, int) for x in given):
        items = [list(given)]
    else:
        items = list(given)
    if not items:
        raise OpenAIError(f"{param} must not be empty.", param=param)
    if len(items) > MAX_INPUTS:
        raise OpenAIError(f"at most {MAX_INPUTS} inputs per request, got {len(items)}.", param=param)
    return [render_one(serving, item, body, param) for item in items]


def render_one(
    serving: OpenAIServing,
    item: str | list[int],
    body: PoolingFields,
    param: str,
    pair: str | None = None,
    doc_tokens: int | None = None,
) -> PoolingPrompt:
    """One input; pair: a cross-encoder's second text; doc_tokens: the document's own cut (rerank's
    max_tokens_per_doc: the document alone, or the pair's second text, keeps at most this many tokens)."""
    info = serving.model_info
    limit = info.max_model_len
    keep = body.truncate_prompt_tokens
    keep = limit if keep == -1 else keep
    token_type_start = None
    if isinstance(item, str):
        if not item or (pair is not None and not pair):
            raise OpenAIError(f"{param} must not hold an empty string.", param=param)
        tokenizer = serving.require_tokenizer(param)
        truncation: dict[str, Any] = {"truncation": True, "max_length": keep} if keep is not None else {}
        if doc_tokens is not None:
            specials = tokenizer.num_special_tokens_to_add(pair=pair is not None)
            query = len(tokenizer(item, add_special_tokens=False)["input_ids"]) if pair is not None else 0
            limit_doc = query + doc_tokens + specials
            truncation = {
                "truncation": "only_second" if pair is not None else True,
                "max_length": min(limit_doc, keep) if keep is not None else limit_doc,
            }
        args = (item,) if pair is None else (item, pair)
        encoded = tokenizer(*args, add_special_tokens=body.add_special_tokens, **truncation)
        ids = list(encoded["input_ids"])
        types = encoded.get("token_type_ids")
        if pair is not None and types is not None and 1 in types:
            token_type_start = list(types).index(1)
    else:
        if not item:
            raise OpenAIError(f"{param} must not hold an empty list of token ids.", param=param)
        ids = list(item)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        if any(not 0 <= t < info.vocab_size for t in ids):
            raise OpenAIError(f"token ids must be in [0, {info.vocab_size}).", param=param)
    if len(ids) > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested {len(ids)} "
            f"tokens in the input. Please reduce the length of the input, or set truncate_prompt_tokens.",
            param=param,
        )
    return PoolingPrompt(ids, token_type_start)


async def pool_all(
    serving: OpenAIServing,
    prompts: list[PoolingPrompt],
    params: PoolingParams,
    body: PoolingFields,
    prefix: str,
    request: Request,
) -> tuple[str, list[np.ndarray]]:
    """Every prompt at once on the engine (it batches them); the request id and each pooled array. A
    client that goes away cancels them (their engine requests are aborted), as on the generation doors."""
    serving.admit()
    serving.check_priority(body.priority)
    await serving.check_model(body.model)
    request_id = body.request_id or new_request_id(prefix)
    base = new_request_id(prefix)
    work = [
        serving.llm.encode(
            f"{base}-{i}",
            prompt.token_ids,
            params if prompt.token_type_start is None else _with_types(params, prompt.token_type_start),
            priority=body.priority,
            cache_salt=body.cache_salt,
            lora_name=serving.lora_name(body.model),
        )
        for i, prompt in enumerate(prompts)
    ]
    outputs = await until_disconnected(request, gather_all(work))
    return request_id, [as_array(output) for output in outputs]


def _with_types(params: PoolingParams, start: int) -> PoolingParams:
    return msgspec.structs.replace(params, token_type_start=start)


def as_array(output: PooledOutput) -> np.ndarray:
    return np.frombuffer(output.data, dtype="<f4").reshape(output.shape)


def usage(prompts: list[PoolingPrompt]) -> dict[str, int]:
    tokens = sum(len(p.token_ids) for p in prompts)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def envelope(
    request_id: str, model: str, data: list[dict[str, Any]], prompts: list[PoolingPrompt]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(prompts),
    }
