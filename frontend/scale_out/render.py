"""POST /v1/chat/completions/render and /v1/completions/render: a chat or completions body in, the
GenerateRequest(s) that /inference/v1/generate computes the same answer from out (vLLM's render step for a
router that splits rendering, generation and derendering).

Each runs its door's own preparation (the chat template, the tool plan, the generation config's defaults,
max_tokens), then writes every sampling value explicitly, so the generate door, which fills unset fields
with SamplingParams' defaults, needs nothing from the first server."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.openai.chat import prepare_chat
from frontend.openai.common import Serving, json_response
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import completion_prompts
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from frontend.openai.structured import spec_of_request
from frontend.server.errors import OpenAIError
from protocol.sampling import SamplingParams

router = APIRouter()

# our SamplingParams fields that vLLM's SamplingParams names the same
SAME_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
              "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens",
              "spaces_between_special_tokens", "allowed_token_ids")  # fmt: skip


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request, serving: Serving) -> Response:
    await serving.check_model(body.model)
    base = request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
    run, params = await prepare_chat(body, serving, f"chatcmpl-{base}")
    if run.mm_inputs:
        raise OpenAIError("render does not carry images yet: send the chat to /v1/chat/completions.",
                          param="messages", code="unsupported_field")  # fmt: skip
    return json_response(generate_request(run.request_id, run.prompt_ids, params, body))


@router.post("/v1/completions/render")
async def render_completions(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    body.check_supported()
    serving.check_priority(body.priority)
    await serving.check_model(body.model)
    serving.model_name(body.model)
    if body.echo:
        raise OpenAIError("render does not carry echo: the router has the prompt.", param="echo")
    prompts = completion_prompts(serving, body)
    top = check_top(body.logprobs, "logprobs")
    max_tokens = body.max_tokens
    if "max_tokens" not in body.model_fields_set and "max_tokens" in serving.defaults:
        max_tokens = min(16, int(serving.defaults["max_tokens"]))  # the completions door's rule
    spec = spec_of_request(body, serving.validator)
    base = f"cmpl-{request.headers.get('x-request-id') or body.request_id or uuid.uuid4().hex}"
    answers = []
    for p, prompt in enumerate(prompts):
        params = to_sampling_params(body, model_info=serving.model_info, defaults=serving.defaults,
                                    tokenizer=serving.tokenizer, num_prompt_tokens=len(prompt.token_ids),
                                    max_tokens=max_tokens, logprobs=top, prompt_logprobs=body.prompt_logprobs,
                                    prompt_param="prompt", structured_outputs=spec)  # fmt: skip
        request_id = base if len(prompts) == 1 else f"{base}-{p}"
        answers.append(generate_request(request_id, prompt.token_ids, params, body))
    return json_response(answers)


def generate_request(
    request_id: str, token_ids: list[int], params: SamplingParams, body: SamplingFields
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "sampling_params": vllm_sampling_params(params, body),
        "model": body.model,
        "stream": body.stream,
        "stream_options": body.stream_options.model_dump() if body.stream and body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
    }


def vllm_sampling_params(params: SamplingParams, body: SamplingFields) -> dict[str, Any]:
    """Our resolved sampling values under vLLM's SamplingParams names."""
    values: dict[str, Any] = {name: getattr(params, name) for name in SAME_NAMES}
    values["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()} if params.logit_bias else None
    values["bad_words"] = body.bad_words  # the generate door tokenizes them as the first door did
    values["detokenize"] = True
    spec = params.structured_outputs
    if spec is not None:
        if spec.start_after_token_ids:
            raise OpenAIError(
                "render does not carry structured outputs that begin after the reasoning yet: send the request "
                "to its door.", param="structured_outputs", code="unsupported_field",
            )  # fmt: skip
        fields = msgspec.structs.asdict(spec)
        del fields["start_after_token_ids"]
        values["structured_outputs"] = {k: v for k, v in fields.items() if v not in (None, False)}
    return values
