"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request, one chat.completion
whose choice i answers conversation i.

The body is a chat request whose `messages` is a list of conversations; every other field applies to
each of them. Each conversation goes through the chat door's own code (chat.prepare_chat, chat.full_body),
so a conversation gets the same tokens here as alone on /v1/chat/completions. As in vLLM: no streaming,
n must be 1, usage is the sum over the conversations, and one bad conversation fails the whole request
(a 400 naming it) before anything is generated.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import field_validator

from frontend.engine.async_llm import final_state, gather_all, new_request_id
from frontend.openai.chat import full_body, prepare_chat
from frontend.openai.common import (
    Serving,
    caller_request_id,
    echoes_request_id,
    id_headers,
    json_response,
    until_disconnected,
)
from frontend.openai.format import usage
from frontend.openai.schemas import ROLES, ChatCompletionRequest
from frontend.server.errors import OpenAIError

router = APIRouter()
logger = logging.getLogger("engine.api")


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: list[list[dict[str, Any]]]  # type: ignore[assignment]  # conversations, each a chat's messages

    @field_validator("messages")
    @classmethod
    def _roles(  # type: ignore[override]  # the same check, over a list of conversations
        cls, conversations: list[list[dict[str, Any]]]
    ) -> list[list[dict[str, Any]]]:
        # Replaces the chat request's check of the same name: the roles are checked per conversation.
        if not conversations:
            raise ValueError("messages must hold at least one conversation.")
        for c, conversation in enumerate(conversations):
            if not conversation:
                raise ValueError(f"messages[{c}] must not be empty.")
            for index, message in enumerate(conversation):
                if message.get("role") not in ROLES:
                    raise ValueError(
                        f"messages[{c}][{index}].role must be one of {', '.join(ROLES)}; "
                        f"got {message.get('role')!r}."
                    )
        return conversations

    def conversation(self, index: int) -> ChatCompletionRequest:
        """Conversation `index` as a chat request of its own; only the fields the caller set count as
        set, as they would on /v1/chat/completions (generation-config defaults fill the rest)."""
        fields = self.model_dump(exclude_unset=True, exclude={"messages"})
        return ChatCompletionRequest.model_validate({**fields, "messages": self.messages[index]})


@router.post("/v1/chat/completions/batch")
@echoes_request_id
async def chat_completions_batch(
    body: BatchChatCompletionRequest, request: Request, serving: Serving
) -> Response:
    serving.admit()
    if body.stream:
        raise OpenAIError("stream is not supported by /v1/chat/completions/batch.", param="stream")
    if body.n != 1:
        raise OpenAIError("/v1/chat/completions/batch takes n = 1 only.", param="n")
    if len(body.messages) > serving.limits.max_prompts:
        raise OpenAIError(
            f"at most {serving.limits.max_prompts} conversations per request, got {len(body.messages)}.",
            param="messages",
        )
    request_id = new_request_id("chatcmpl")
    prepared = []
    for index in range(len(body.messages)):
        try:
            prepared.append(await prepare_chat(body.conversation(index), serving, f"{request_id}-{index}"))
        except OpenAIError as error:
            error.message = f"messages[{index}]: {error.message}"
            if error.param is not None and error.param.startswith("messages["):  # one conversation's
                error.param = f"messages[{index}]{error.param.removeprefix('messages')}"
            raise
    log_id = caller_request_id(request, body)
    work = [final_state(run.generate(params, log_id)) for run, params in prepared]
    states = await until_disconnected(request, gather_all(work))
    choices: list[dict[str, Any]] = []
    num_prompt = num_output = num_cached = 0
    for index, ((run, _), state) in enumerate(zip(prepared, states, strict=True)):
        one = full_body(run, state)
        (choice,) = one["choices"]
        choice["index"] = index
        # Per-prompt extras of a chat body belong to the conversation's choice here.
        for name in ("prompt_logprobs", "prompt_token_ids"):
            if name in one:
                choice[name] = one[name]
        choices.append(choice)
        num_prompt += len(state.prompt_token_ids)
        num_output += state.num_output_tokens
        num_cached += state.num_cached_tokens
    first = prepared[0][0]
    result = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": first.model,
        "choices": choices,
        "usage": usage(num_prompt, num_output, num_cached),
    }
    return json_response(result, id_headers(request, body))
