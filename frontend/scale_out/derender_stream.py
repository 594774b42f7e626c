"""Streamed derender: `stream: true` on /v1/chat/completions/derender and /v1/completions/derender, vLLM's
stateless form. A router sends one call per SSE chunk of a streamed /inference/v1/generate, with the
`stream_state` the previous call returned (none on the first); each answer is the door's chunk for it and
the state to send with the next.

No server keeps anything between calls: the state carries the choice's output token ids so far, and each
call replays them through a fresh output processor (the request's detokenizer settings and stop strings)
before it adds the chunk's, so the chunk's text is exactly what the door would have streamed after them
(a stop string's held-back prefix included). A chat request's tool and reasoning parsers read the replayed
text as the door's stream reads it, so a chunk's delta carries the reasoning, content and call fragments the
door would have sent for its tokens; a call's id, given once in its first fragment, is kept in the state.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend.engine.output_processor import Choice, OutputProcessor
from frontend.engine.pieces import Pieces
from frontend.openai.chat import delta_message, prepare_chat
from frontend.openai.common import json_response
from frontend.openai.format import CompletionLogprobs, chat_logprobs, usage
from frontend.openai.params import check_top, to_sampling_params
from frontend.openai.render import completion_prompts
from frontend.openai.schemas import ChatCompletionRequest, CompletionRequest
from frontend.openai.structured import spec_of_request
from frontend.parsers.base import CallDelta
from frontend.scale_out.generate import from_token_logprobs
from frontend.server.errors import OpenAIError
from protocol.messages import RequestOutput
from protocol.sampling import SamplingParams


class StreamState(BaseModel):
    """vLLM's DerenderStreamState: what the client carries from one call to the next."""

    model_config = ConfigDict(extra="forbid")

    prior_token_ids: list[int] = Field(default_factory=list)  # the choice's output ids before this chunk
    role_sent: bool = False  # the first chunk carried the role
    last_content: str | None = None  # (vLLM's fields for parsed streams; unused while those are refused)
    last_reasoning: str | None = None
    last_tool_call_ids: list[str] = Field(default_factory=list)


class DerenderChatStream(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: Literal[True]
    model: str | None = None
    generate_chunk: dict[str, Any]  # one SSE chunk of /inference/v1/generate (stream true)
    stream_state: StreamState | None = None
    prompt_tokens: int | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionStream(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: Literal[True]
    model: str | None = None
    generate_chunk: dict[str, Any]
    stream_state: StreamState | None = None
    prompt_tokens: int | None = None
    completion_request: CompletionRequest | None = None


def chunk_choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk's one choice (None: a usage-only chunk); a chunk of several is refused, as vLLM does."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) > 1:
        raise OpenAIError("a streamed derender call takes one generate chunk of at most one choice.",
                          param="generate_chunk")  # fmt: skip
    return choices[0] if choices else None


def merged(deltas: list[Pieces]) -> Pieces:
    """Several tokens' pieces as one chunk's: texts joined, each call's fragments joined."""
    out = Pieces()
    calls: dict[int, CallDelta] = {}
    for delta in deltas:
        out.content += delta.content
        out.reasoning += delta.reasoning
        for call in delta.calls:
            known = calls.setdefault(call.index, CallDelta(call.index))
            if call.id is not None:
                known.id, known.name = call.id, call.name
            known.arguments += call.arguments
    out.calls = [calls[index] for index in sorted(calls)]
    return out


def advance(serving: Any, prompt: list[int], params: SamplingParams, state: StreamState, choice: dict[str, Any],
            parser: Any = None) -> tuple[Choice, Pieces, Any, StreamState]:  # fmt: skip
    """Replay the state's ids, then add the chunk's: the choice after it, the pieces it adds (the text, or
    what the parser read in it), the chunk's logprobs and the next state."""
    processor = OutputProcessor(serving.tokenizer)
    request, _ = processor.add_request("derender", prompt, params, parser=parser)
    child = request.child_id(0)
    for token_id in state.prior_token_ids:
        processor.process(request, RequestOutput(child, [token_id]))
    reading = request.choices[0].pieces.parse
    if reading is not None:  # the ids the client was given for the calls so far
        for call, call_id in zip(reading.sent.calls, state.last_tool_call_ids, strict=False):
            call.id = call_id
    new = [int(t) for t in choice.get("token_ids") or []]
    rows = None
    if params.logprobs is not None and new:
        content = (choice.get("logprobs") or {}).get("content")
        if content is None or len(content) != len(new):
            raise OpenAIError("the request asks for logprobs and the chunk has none for its tokens.",
                              param="generate_chunk")  # fmt: skip
        rows = from_token_logprobs(content, params.logprobs)
    finish = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    if finish == "abort" and stop_reason is None:
        stop_reason = "abort"  # an abort_requests' end, not the engine's failure
    steps = [[t] for t in new] or [[]]
    deltas = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if request.choices[0].finished:
            break  # a stop string ended it inside this chunk
        delta = processor.process(request, RequestOutput(child, step, finish_reason=finish if last else None,
                                                         stop_reason=stop_reason if last else None))  # fmt: skip
        if delta is not None:
            deltas.append(delta.pieces)
    taken = request.choices[0]
    pieces = merged(deltas)
    ids = list(state.last_tool_call_ids) + [call.id for call in pieces.calls if call.id is not None]
    after = StreamState(prior_token_ids=state.prior_token_ids + new, role_sent=True,
                        last_content=taken.parsed.content if reading is not None else taken.text,
                        last_reasoning=taken.parsed.reasoning if reading is not None else None,
                        last_tool_call_ids=ids)  # fmt: skip
    return taken, pieces, rows, after


def check_chunk_params(params: SamplingParams) -> None:
    if params.n != 1:
        raise OpenAIError("a streamed derender call reads one choice: n must be 1.", param="n")


async def derender_chat_stream(body: DerenderChatStream, serving: Any) -> Any:
    if body.chat_request is None:
        raise OpenAIError("chat_request is needed: the chunk is read with the request's settings.",
                          param="chat_request")  # fmt: skip
    chunk = body.generate_chunk
    request_id = (
        str(chunk.get("request_id") or "").removeprefix("generate-tokens-") or f"chatcmpl-{int(time.time())}"
    )
    run, params = await prepare_chat(body.chat_request, serving, request_id)
    check_chunk_params(params)
    state = body.stream_state or StreamState()
    envelope = {"id": run.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model or run.model, "system_fingerprint": serving.system_fingerprint}  # fmt: skip
    choice = chunk_choice(chunk)
    prompt_tokens = body.prompt_tokens if body.prompt_tokens is not None else len(run.prompt_ids)
    if choice is None:  # the usage chunk
        output_tokens = len(state.prior_token_ids)
        answer = {**envelope, "choices": [], "usage": usage(prompt_tokens, output_tokens, 0)}
        return json_response({"chunk": answer, "stream_state": state.model_dump()})
    parser = run.plan if run.plan.parses else None
    taken, pieces, rows, after = advance(serving, run.prompt_ids, params, state, choice, parser)
    delta = delta_message(pieces, body.chat_request.include_reasoning) or {"content": ""}
    if not state.role_sent:
        delta = {"role": run.role, **delta}
    num_top = params.logprobs or 0
    logprobs = None
    if body.chat_request.logprobs and rows is not None:
        as_ids = body.chat_request.return_tokens_as_token_ids
        logprobs = {"content": chat_logprobs(rows, num_top, serving.token_text, as_ids)}
    piece = {"index": int(choice.get("index", 0)), "delta": delta, "logprobs": logprobs,
             "finish_reason": taken.reported_finish_reason, "stop_reason": taken.stop_reason}  # fmt: skip
    return json_response({"chunk": {**envelope, "choices": [piece]}, "stream_state": after.model_dump()})


def completion_request(completion: CompletionRequest | None) -> CompletionRequest:
    """A derender's completion_request, checked as the door checks it (echo is not carried)."""
    if completion is None:
        raise OpenAIError("completion_request is needed: the answer is read with the request's settings.",
                          param="completion_request")  # fmt: skip
    completion.check_supported()
    if completion.echo:
        raise OpenAIError("derender does not carry echo: the router has the prompt.",
                          param="completion_request.echo")  # fmt: skip
    return completion


async def derender_completion_stream(body: DerenderCompletionStream, serving: Any) -> Any:
    completion = completion_request(body.completion_request)
    prompts = completion_prompts(serving, completion)
    if len(prompts) != 1:
        raise OpenAIError(
            "a streamed derender call reads one prompt's chunks.", param="completion_request.prompt"
        )
    prompt = prompts[0]
    params = to_sampling_params(
        completion, model_info=serving.model_info, defaults=serving.defaults, tokenizer=serving.tokenizer,
        num_prompt_tokens=len(prompt.token_ids), max_tokens=completion.max_tokens,
        logprobs=check_top(completion.logprobs, "logprobs"), prompt_logprobs=None, prompt_param="prompt",
        structured_outputs=spec_of_request(completion, serving.validator),
    )  # fmt: skip
    check_chunk_params(params)
    chunk = body.generate_chunk
    state = body.stream_state or StreamState()
    request_id = (
        str(chunk.get("request_id") or "").removeprefix("generate-tokens-") or f"cmpl-{int(time.time())}"
    )
    envelope = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model or completion.model or serving.model_name(None),
                "system_fingerprint": serving.system_fingerprint}  # fmt: skip
    choice = chunk_choice(chunk)
    if choice is None:
        prompt_tokens = body.prompt_tokens if body.prompt_tokens is not None else len(prompt.token_ids)
        answer = {**envelope, "choices": [], "usage": usage(prompt_tokens, len(state.prior_token_ids), 0)}
        return json_response({"chunk": answer, "stream_state": state.model_dump()})
    taken, pieces, rows, after = advance(serving, prompt.token_ids, params, state, choice)
    logprobs = None
    if params.logprobs is not None and rows is not None:
        as_ids = completion.return_tokens_as_token_ids
        builder = CompletionLogprobs(params.logprobs, serving.token_text, as_ids)
        builder.offset = sum(len(serving.token_text(t, as_ids)) for t in state.prior_token_ids)  # as the door
        logprobs = builder.output(rows)
    piece = {"index": int(choice.get("index", 0)), "text": pieces.content, "logprobs": logprobs,
             "finish_reason": taken.finish_reason, "stop_reason": taken.stop_reason}  # fmt: skip
    return json_response({"chunk": {**envelope, "choices": [piece]}, "stream_state": after.model_dump()})
