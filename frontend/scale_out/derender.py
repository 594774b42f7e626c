"""POST /v1/chat/completions/derender and /v1/completions/derender: what /inference/v1/generate answered
(token ids, finish reasons, logprobs), with the request it was rendered from, in; that door's answer out,
as its door would have given it (vLLM's derender step, for a router that generates elsewhere).

The request is prepared again as its door prepares it (the chat template, the tool plan, the sampling
values), and each choice's tokens pass the same output processor as an engine's would: detokenized with
the request's settings, cut at its stop strings, read by its tool and reasoning parsers. `stream: true`
derenders one generate chunk a call, the client carrying the state (frontend/scale_out/derender_stream.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from frontend.engine.output_processor import OutputProcessor, RequestState
from frontend.openai.chat import full_body, prepare_chat
from frontend.openai.common import Serving, json_response
from frontend.openai.completions import CompletionRun, completion_body
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import completion_prompts
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from frontend.openai.structured import spec_of_request
from frontend.scale_out.derender_stream import (
    DerenderChatStream,
    DerenderCompletionStream,
    completion_request,
    derender_chat_stream,
    derender_completion_stream,
)
from frontend.scale_out.generate import from_token_logprobs
from frontend.server.errors import OpenAIError
from protocol.messages import Logprobs, RequestOutput
from protocol.sampling import SamplingParams

router = APIRouter()
PREFIX = "generate-tokens-"


class DerenderChat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: Literal[False] = False
    model: str | None = None
    generate_response: dict[str, Any]
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[dict[str, Any]]
    prompt_tokens: list[int] | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    completion_request: CompletionRequest | None = None


@router.post("/v1/chat/completions/derender")
async def derender_chat(body: DerenderChat | DerenderChatStream, serving: Serving) -> Response:
    if isinstance(body, DerenderChatStream):
        serving.require_tokenizer("generate_chunk")
        return await derender_chat_stream(body, serving)  # type: ignore[no-any-return]
    serving.require_tokenizer("generate_response")
    if body.chat_request is None:
        raise OpenAIError("chat_request is needed: the answer is read with the request's settings and parsers.",
                          param="chat_request")  # fmt: skip
    chat = body.chat_request
    response = tokens_response(body.generate_response, "generate_response")
    run, params = await prepare_chat(chat, serving, request_id_of(response, "chatcmpl-"))
    if body.model is not None:
        run.model = body.model
    prompt = body.prompt_token_ids or response.get("prompt_token_ids") or run.prompt_ids
    state = replay(serving, run.request_id, prompt, params, response, "generate_response",
                   run.plan if run.plan.parses else None)  # fmt: skip
    answer = full_body(run, state)
    answer["usage"]["prompt_tokens"] = body.prompt_tokens if body.prompt_tokens is not None else len(prompt)
    answer["usage"]["total_tokens"] = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    return json_response(answer)


@router.post("/v1/completions/derender")
async def derender_completions(
    body: DerenderCompletion | DerenderCompletionStream, serving: Serving
) -> Response:
    if isinstance(body, DerenderCompletionStream):
        serving.require_tokenizer("generate_chunk")
        return await derender_completion_stream(body, serving)  # type: ignore[no-any-return]
    serving.require_tokenizer("generate_responses")
    completion = completion_request(body.completion_request)
    prompts = completion_prompts(serving, completion)
    if len(prompts) != len(body.generate_responses):
        raise OpenAIError(f"{len(body.generate_responses)} generate_responses for {len(prompts)} prompts.",
                          param="generate_responses")  # fmt: skip
    top = check_top(completion.logprobs, "logprobs")
    spec = spec_of_request(completion, serving.validator)
    params, states = [], []
    for p, (prompt, raw) in enumerate(zip(prompts, body.generate_responses, strict=True)):
        response = tokens_response(raw, f"generate_responses[{p}]")
        choice_params = to_sampling_params(
            completion, model_info=serving.model_info, defaults=serving.defaults, tokenizer=serving.tokenizer,
            num_prompt_tokens=len(prompt.token_ids), max_tokens=completion.max_tokens, logprobs=top,
            prompt_logprobs=completion.prompt_logprobs, prompt_param="prompt", structured_outputs=spec,
        )  # fmt: skip
        params.append(choice_params)
        states.append(replay(serving, f"cmpl-{p}", prompt.token_ids, choice_params, response,
                             f"generate_responses[{p}]", None))  # fmt: skip
    first = tokens_response(body.generate_responses[0], "generate_responses[0]")
    model = body.model or completion.model or serving.model_name(None)
    run = CompletionRun(serving, request_id_of(first, "cmpl-"), model, int(time.time()), completion, prompts,
                        params, top)  # fmt: skip
    answer = completion_body(run, states)
    if body.prompt_tokens is not None:
        answer["usage"]["prompt_tokens"] = sum(body.prompt_tokens)
        answer["usage"]["total_tokens"] = (
            answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        )
    return json_response(answer)


def tokens_response(response: dict[str, Any], param: str) -> dict[str, Any]:
    if response.get("output_mode", "tokens") != "tokens":
        raise OpenAIError(
            "only output_mode 'tokens' answers are derendered (text ones already are).", param=param
        )
    if not isinstance(response.get("choices"), list):
        raise OpenAIError("a generate answer has choices.", param=param)
    return response


def request_id_of(response: dict[str, Any], prefix: str) -> str:
    """The id the door's answer carries: the render's (what generate prefixed), else a new one."""
    request_id = str(response.get("request_id") or "")
    request_id = request_id.removeprefix(PREFIX)
    return request_id if request_id.startswith(prefix) else f"{prefix}{request_id or int(time.time())}"


def replay(serving: Any, request_id: str, prompt: list[int], params: SamplingParams, response: dict[str, Any],
           param: str, parser: Any) -> RequestState:  # fmt: skip
    """Each choice's tokens through a fresh output processor one at a time, as its engine request produced
    them, the last with its finish."""
    choices = response["choices"]
    if len(choices) != params.n:
        raise OpenAIError(f"{len(choices)} choices for n={params.n}.", param=param)
    processor = OutputProcessor(serving.tokenizer)
    state, _ = processor.add_request(request_id, prompt, params, parser=parser, incremental=False)
    for choice in choices:
        index = int(choice.get("index", 0))
        if not 0 <= index < params.n:
            raise OpenAIError(f"a choice's index {index} is not one of n={params.n}.", param=param)
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        rows = None
        if params.logprobs is not None:
            content = (choice.get("logprobs") or {}).get("content")
            if content is None or len(content) != len(token_ids):
                raise OpenAIError(
                    "the request asks for logprobs and a choice has none for its tokens.", param=param
                )
            rows = from_token_logprobs(content, params.logprobs)
        finish = choice.get("finish_reason") or "stop"
        stop_reason = choice.get("stop_reason")
        if finish == "abort" and stop_reason is None:
            stop_reason = "abort"  # an abort_requests' end, not the engine's failure
        steps = [(token_ids[i : i + 1], i) for i in range(len(token_ids))] or [([], -1)]
        for new, i in steps:
            last = i == len(token_ids) - 1
            logprobs = None
            if rows is not None and new:
                logprobs = Logprobs(
                    rows.token_ids[i : i + 1], rows.logprobs[i : i + 1], rows.ranks[i : i + 1]
                )
            output = RequestOutput(state.child_id(index), new, finish_reason=finish if last else None,
                                   stop_reason=stop_reason if last else None, new_logprobs=logprobs)  # fmt: skip
            processor.process(state, output)
    return state
