"""POST /v1/completions: prompts (text or token ids) -> engine -> text_completion (JSON or SSE).

Every prompt of a request runs at once, so the engine batches them; choice `p * n + i` is choice i of
prompt p. echo prepends the prompt (and, with logprobs, its tokens' logprobs, the first one None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from frontend.engine.async_llm import final_state, gather_all, merged, new_request_id
from frontend.engine.output_processor import Delta, RequestState
from frontend.openai.common import (
    Run,
    Serving,
    caller_request_id,
    echoes_request_id,
    id_headers,
    json_response,
    metadata_of,
    until_disconnected,
)
from frontend.openai.format import (
    SSE_DONE,
    CompletionLogprobs,
    merge_completion_logprobs,
    prompt_logprobs_body,
    sse,
    usage,
)
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import Prompt, completion_prompts
from frontend.openai.schemas import CompletionRequest
from frontend.openai.structured import spec_of_request
from frontend.server.errors import OpenAIError, to_openai_error
from protocol.sampling import SamplingParams

router = APIRouter()
logger = logging.getLogger("engine.api")


@dataclass
class CompletionRun(Run):
    body: CompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]
    num_top: int | None
    # (prompt, choice) -> its logprobs builder, which carries the choice's text offset
    builders: dict[tuple[int, int], CompletionLogprobs] = field(default_factory=dict)

    def builder(self, p: int, index: int) -> CompletionLogprobs:
        key = (p, index)
        if key not in self.builders:
            as_ids = self.body.return_tokens_as_token_ids
            self.builders[key] = CompletionLogprobs(self.num_top or 0, self.serving.token_text, as_ids)
        return self.builders[key]

    def echo_logprobs(self, p: int, index: int, state: RequestState) -> dict[str, Any] | None:
        if self.num_top is None:
            return None
        return self.builder(p, index).prompt(self.prompts[p].token_ids, state.prompt_logprobs)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(self.envelope("text_completion", choices, **extra))

    def generate(self, p: int, request: Request) -> Any:
        return self.serving.llm.generate(
            f"{self.request_id}-{p}",
            self.prompts[p].token_ids,
            self.params[p],
            priority=self.body.priority,
            cache_salt=self.body.cache_salt,
            log_id=caller_request_id(request, self.body),
            lora_name=self.serving.lora_name(self.body.model),
            kv_transfer_params=self.body.kv_transfer_params,
        )


@router.post("/v1/completions")
@echoes_request_id
async def completions(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    serving.admit()
    body.check_supported()
    serving.check_priority(body.priority)
    await serving.check_model(body.model)
    model = serving.model_name(body.model)
    prompts = completion_prompts(serving, body)
    if body.kv_transfer_params is not None and len(prompts) > 1:
        raise OpenAIError("kv_transfer_params takes one prompt.", param="kv_transfer_params")
    top = check_top(body.logprobs, "logprobs")
    prompt_logprobs = body.prompt_logprobs
    if body.echo and top is not None and prompt_logprobs is None:
        prompt_logprobs = top  # echo with logprobs shows the prompt's, as vLLM and OpenAI do
    max_tokens = body.max_tokens
    if "max_tokens" not in body.model_fields_set and "max_tokens" in serving.defaults:
        # vLLM's rule: the smaller of the door's default (16) and the generation config's
        max_tokens = min(16, int(serving.defaults["max_tokens"]))
    spec = spec_of_request(body, serving.validator)
    params = [
        to_sampling_params(
            body,
            model_info=serving.model_info,
            defaults=serving.defaults,
            tokenizer=serving.tokenizer,
            num_prompt_tokens=len(prompt.token_ids),
            max_tokens=max_tokens,
            logprobs=top,
            prompt_logprobs=prompt_logprobs,
            prompt_param="prompt",
            structured_outputs=spec,
        )
        for prompt in prompts
    ]
    run = CompletionRun(serving, new_request_id("cmpl"), model, int(time.time()), body, prompts, params, top)
    if metadata := metadata_of(body):
        logger.debug("request %s metadata: %s", run.request_id, metadata)
    headers = id_headers(request, body)
    if body.stream:
        return StreamingResponse(_stream(run, request), media_type="text/event-stream", headers=headers)

    work = [final_state(run.generate(p, request)) for p in range(len(prompts))]
    states = await until_disconnected(request, gather_all(work))
    return json_response(completion_body(run, states), headers)


def completion_body(run: CompletionRun, states: list[RequestState]) -> dict[str, Any]:
    body, token_text = run.body, run.serving.token_text
    choices = []
    for p, state in enumerate(states):
        prompt = run.prompts[p]
        for choice in state.choices:
            logprobs = None
            if run.num_top is not None:
                builder = run.builder(p, choice.index)
                if body.echo:
                    logprobs = run.echo_logprobs(p, choice.index, state)
                if choice.logprobs is not None:
                    logprobs = merge_completion_logprobs(logprobs, builder.output(choice.logprobs))
            entry: dict[str, Any] = {
                "index": p * body.n + choice.index,
                "text": ((prompt.text or "") if body.echo else "") + choice.text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if body.prompt_logprobs is not None:
                entry["prompt_logprobs"] = prompt_logprobs_body(state.prompt_logprobs, token_text)
            if body.return_token_ids:
                entry["prompt_token_ids"] = prompt.token_ids
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
    total_prompt = sum(len(prompt.token_ids) for prompt in run.prompts)
    total_output = sum(state.num_output_tokens for state in states)
    cached = sum(state.num_cached_tokens for state in states)
    result = run.envelope("text_completion", choices, usage=usage(total_prompt, total_output, cached))
    if len(states) == 1 and states[0].kv_transfer_params is not None:
        result["kv_transfer_params"] = states[0].kv_transfer_params
    return result


async def _stream(run: CompletionRun, request: Request) -> AsyncIterator[bytes]:
    body = run.body
    options = body.stream_options
    include_usage = run.serving.include_usage(options)
    continuous = options is not None and options.continuous_usage_stats
    total_prompt = sum(len(prompt.token_ids) for prompt in run.prompts)
    states: dict[int, RequestState] = {}
    echoed: set[tuple[int, int]] = set()

    def totals() -> dict[str, Any]:
        output = sum(s.num_output_tokens for s in states.values())
        return usage(total_prompt, output, sum(s.num_cached_tokens for s in states.values()))

    try:
        streams = [run.generate(p, request) for p in range(len(run.prompts))]
        async for p, (state, delta) in merged(streams):
            states[p] = state
            for piece in _pieces(run, p, state, delta, echoed):
                yield run.chunk([piece], **({"usage": totals()} if continuous else {}))
    except Exception as error:
        yield sse(to_openai_error(error).body())
        yield SSE_DONE
        return
    if include_usage:
        yield run.chunk([], usage=totals())
    yield SSE_DONE


def _pieces(
    run: CompletionRun, p: int, state: RequestState, delta: Delta, echoed: set[tuple[int, int]]
) -> list[dict[str, Any]]:
    """The SSE choices one delta makes: the echoed prompt first (once per choice), then the new text."""
    body, index = run.body, p * run.body.n + delta.index
    pieces: list[dict[str, Any]] = []
    prompt_done = bool(delta.token_ids) or delta.finish_reason is not None  # prompt logprobs complete
    if body.echo and prompt_done and (p, delta.index) not in echoed:
        echoed.add((p, delta.index))
        echo: dict[str, Any] = {
            "index": index,
            "text": run.prompts[p].text or "",
            "logprobs": run.echo_logprobs(p, delta.index, state),
            "finish_reason": None,
        }
        if body.return_token_ids:
            echo["prompt_token_ids"] = run.prompts[p].token_ids
        pieces.append(echo)
    logprobs = None
    if run.num_top is not None and delta.logprobs is not None:
        logprobs = run.builder(p, delta.index).output(delta.logprobs)
    with_ids = body.return_token_ids and bool(delta.token_ids)
    if delta.text or logprobs is not None or delta.finish_reason is not None or with_ids:
        piece: dict[str, Any] = {
            "index": index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if body.return_token_ids:
            piece["token_ids"] = delta.token_ids
            if not body.echo and (p, delta.index) not in echoed:
                echoed.add((p, delta.index))
                piece["prompt_token_ids"] = run.prompts[p].token_ids
        pieces.append(piece)
    return pieces
