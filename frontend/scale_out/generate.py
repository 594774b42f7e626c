"""POST /inference/v1/generate: vLLM's tokens in, tokens out. A prompt's token ids and vLLM's SamplingParams
in; each choice's token ids (and, with output_mode "text", its text) out, as JSON or SSE. It runs the
completions door's path for a token prompt, so its tokens equal /v1/completions' for the same ids and
parameters; as in vLLM, unset sampling fields take SamplingParams' defaults (not the generation config's)
and max_tokens the rest of the context.

POST /inference/v1/abort_requests (and /abort_requests on a --tokens-only server) ends requests by the
request_id their answers carry."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.engine.async_llm import final_state
from frontend.engine.output_processor import Choice, Delta, RequestState
from frontend.openai.common import Serving, json_response, until_disconnected
from frontend.openai.format import SSE_DONE, chat_logprobs, prompt_logprobs_body, sse, usage
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import completion_prompts
from frontend.openai.schemas import CompletionRequest
from frontend.openai.serving import OpenAIServing
from frontend.openai.structured import spec_of_request
from frontend.scale_out.schemas import AbortRequests, GenerateRequest, label_token_ids
from frontend.server.errors import OpenAIError, to_openai_error
from protocol.messages import Logprobs
from protocol.sampling import MAX_N, SamplingParams

router = APIRouter()
abort_router = APIRouter()


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, request: Request, serving: Serving) -> Response:
    serving.admit()
    body.check_supported()
    completion, detokenize = body.completion()
    completion.check_supported()
    serving.check_priority(body.priority)
    await serving.check_model(body.model)
    model = serving.model_name(body.model)
    if body.output_mode == "text" and (serving.tokenizer is None or not detokenize):
        raise OpenAIError(
            "output_mode 'text' needs a tokenizer (not --tokens-only) and sampling_params.detokenize.",
            param="output_mode",
        )
    prompt_ids, params, top = token_request(serving, completion)
    if (labels := label_token_ids(body.sampling_params)) is not None:  # vLLM's: logprobs is their number
        if params.logprobs not in (None, len(labels)):
            raise OpenAIError(f"sampling_params.logprobs must equal len(logprob_token_ids) ({len(labels)}).",
                              param="sampling_params.logprob_token_ids")  # fmt: skip
        params = msgspec.structs.replace(params, logprob_token_ids=labels, logprobs=len(labels))
        top = len(labels)
    caller_id = request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
    request_id = (
        f"generate-tokens-{caller_id}"  # vLLM's: what abort_requests names (the engine refuses a twin)
    )
    stream = serving.llm.generate(request_id, prompt_ids, params, priority=body.priority,
                                  cache_salt=body.cache_salt, log_id=caller_id,
                                  lora_name=serving.lora_name(body.model),
                                  kv_transfer_params=body.kv_transfer_params)  # fmt: skip
    answer = Answer(body, request_id, model, prompt_ids, top, serving, params.logprob_token_ids)
    if body.stream:
        return StreamingResponse(answer.stream(stream), media_type="text/event-stream")
    state = await until_disconnected(request, final_state(stream))
    return json_response(answer.full(state))


def token_request(
    serving: OpenAIServing, completion: CompletionRequest
) -> tuple[list[int], SamplingParams, int | None]:
    """A tokens-in request's prompt ids, sampling params and number of top logprobs, from the completions
    body that computes the same (vLLM's rules: unset fields take SamplingParams' defaults, not the
    generation config's). The generate door's and the gRPC door's."""
    if serving.tokenizer is None and (completion.stop or completion.bad_words):
        raise OpenAIError(  # vLLM's rule: without a tokenizer these would never match
            "stop strings and bad_words need a tokenizer, which a --tokens-only server does not load: use "
            "stop_token_ids (or check stop strings on the router).",
            param="sampling_params.stop" if completion.stop else "sampling_params.bad_words",
        )
    prompt = completion_prompts(serving, completion)[0]
    top = check_top(completion.logprobs, "sampling_params.logprobs")
    params = to_sampling_params(
        completion,
        model_info=serving.model_info,
        defaults={},
        tokenizer=serving.tokenizer,
        num_prompt_tokens=len(prompt.token_ids),
        max_tokens=completion.max_tokens,
        logprobs=top,
        prompt_logprobs=completion.prompt_logprobs,
        prompt_param="token_ids",
        structured_outputs=spec_of_request(completion, serving.validator),
    )
    return prompt.token_ids, params, top


@router.post("/inference/v1/abort_requests")
@abort_router.post("/abort_requests")
async def abort_requests(body: AbortRequests, serving: Serving) -> Response:
    """End each named request's choices, whichever API server runs it (an id no engine knows is passed
    over, as vLLM does)."""
    await serving.client.cancel(
        [f"{request_id}-{index}" for request_id in body.request_ids for index in range(MAX_N)], "abort"
    )
    return Response(status_code=200)


class Answer:
    """The GenerateResponse (or its SSE chunks) of one request."""

    def __init__(self, body: GenerateRequest, request_id: str, model: str, prompt: list[int], top: int | None,
                 serving: Any, labels: list[int] | None = None) -> None:  # fmt: skip
        self.body, self.request_id, self.model, self.prompt, self.top = body, request_id, model, prompt, top
        self.serving, self.labels = serving, labels
        self.text = body.output_mode == "text"

    def logprobs(self, logprobs: Logprobs | None) -> dict[str, Any] | None:
        if self.top is None or logprobs is None:
            return None
        if self.text:
            return {"content": chat_logprobs(logprobs, max(self.top, 1), self.serving.token_text)}
        return {"content": token_logprobs(logprobs, ranked=self.labels is None)}

    def choice(self, index: int, token_ids: list[int], text: str, logprobs: Logprobs | None,
               finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:  # fmt: skip
        entry: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
                                 "token_ids": token_ids, "logprobs": self.logprobs(logprobs)}  # fmt: skip
        if self.text:
            entry["text"] = text
        return entry

    def full(self, state: RequestState) -> dict[str, Any]:
        choices = [self.full_choice(choice) for choice in state.choices]
        body: dict[str, Any] = {
            "request_id": self.request_id,
            "model": self.model,
            "created": int(time.time()),
            "output_mode": self.body.output_mode,
            "choices": choices,
            "usage": usage(len(self.prompt), state.num_output_tokens, state.num_cached_tokens),
            "prompt_logprobs": prompt_logprobs_body(state.prompt_logprobs, self.serving.token_text),
            "prompt_token_ids": self.prompt if self.body.return_token_ids else None,
            "kv_transfer_params": state.kv_transfer_params,
        }
        return body

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        return self.choice(choice.index, choice.token_ids, choice.text, choice.logprobs,
                           choice.finish_reason or "stop", choice.stop_reason)  # fmt: skip

    async def stream(self, deltas: Any) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        include_usage = self.serving.include_usage(options)
        continuous = options is not None and options.continuous_usage_stats
        generated: dict[int, int] = {}
        state: RequestState | None = None
        first = True
        try:
            async for state, delta in deltas:
                generated[delta.index] = generated.get(delta.index, 0) + len(delta.token_ids)
                if not (delta.token_ids or delta.finish_reason is not None or (self.text and delta.text)):
                    continue
                chunk = self.chunk(delta)
                if first and self.body.return_token_ids:
                    chunk["prompt_token_ids"] = self.prompt
                first = False
                if continuous:
                    chunk["usage"] = usage(len(self.prompt), generated[delta.index], state.num_cached_tokens)
                yield sse(chunk)
        except Exception as error:
            yield sse(to_openai_error(error).body())
            yield SSE_DONE
            return
        if include_usage:
            cached = state.num_cached_tokens if state is not None else 0
            yield sse({"request_id": self.request_id, "output_mode": self.body.output_mode, "choices": [],
                       "usage": usage(len(self.prompt), sum(generated.values()), cached)})  # fmt: skip
        yield SSE_DONE

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = self.choice(delta.index, delta.token_ids, delta.text, delta.logprobs, delta.finish_reason,
                             delta.stop_reason)  # fmt: skip
        return {"request_id": self.request_id, "output_mode": self.body.output_mode, "choices": [choice]}


def token_logprobs(logprobs: Logprobs, ranked: bool = True) -> list[dict[str, Any]]:
    """vLLM's generate shape: per token its id, logprob and rank, and top_logprobs: the sampled token first,
    then the top alternatives by rank, each id once (the engine's dict). Unlike vLLM, which cuts the list to
    the number asked for, an alternative is never dropped when the sampled token ranks below them all: the
    derender door rebuilds the chat door's logprobs from it (frontend/scale_out/derender.py). ranked False:
    the alternatives are logprob_token_ids, whose ranks are not known (None)."""
    entries = []
    for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks, strict=True):
        top: dict[int, dict[str, Any]] = {}
        for position, (token_id, value) in enumerate(zip(ids, values, strict=True)):
            if token_id not in top:
                other_rank = position if ranked else None
                top[token_id] = {"token_id": token_id, "logprob": max(value, -9999.0),
                                 "rank": rank if position == 0 else other_rank}  # fmt: skip
        chosen = next(iter(top.values()))
        entries.append({**chosen, "top_logprobs": list(top.values())})
    return entries


def from_token_logprobs(content: list[dict[str, Any]], num_top: int) -> Logprobs:
    """token_logprobs' inverse: each row the sampled token, then its num_top alternatives by rank (the
    sampled one among them at its rank when it is one of them)."""
    rows_ids, rows_values, ranks = [], [], []
    for entry in content:
        chosen = (entry["token_id"], entry["logprob"])
        others = [(e["token_id"], e["logprob"]) for e in entry.get("top_logprobs", [])[1:]]
        rank = entry.get("rank") or 0
        if 1 <= rank <= num_top:
            others.insert(rank - 1, chosen)
        row = [chosen, *others[:num_top]]
        rows_ids.append([t for t, _ in row])
        rows_values.append([v for _, v in row])
        ranks.append(rank)
    return Logprobs(rows_ids, rows_values, ranks)
