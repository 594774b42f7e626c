"""POST /tokenize and /detokenize (vLLM's), and GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ValidationError

from frontend.openai.common import Serving, json_response
from frontend.openai.render import chat_prompt
from frontend.openai.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from frontend.server.errors import OpenAIError

router = APIRouter()


@router.get("/v1/models")
async def models(serving: Serving) -> Response:
    info = serving.model_info
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "engine",
            "root": info.model,
            "max_model_len": info.max_model_len,
        }
        for name in info.served_model_names
    ]
    return json_response({"object": "list", "data": data})


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Serving) -> Response:
    serving.model_name(body.model)
    if body.messages is not None:
        try:
            chat = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
        except ValidationError as error:  # the same checks as a chat request's messages (roles)
            first = error.errors()[0]
            raise OpenAIError(str(first.get("msg", "invalid messages")), param="messages") from error
        ids = chat_prompt(serving, chat).token_ids
    elif body.prompt is not None:
        tokenizer = serving.require_tokenizer("prompt")
        ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    else:
        raise OpenAIError("Give either prompt or messages.", param="prompt")
    return json_response(
        {"tokens": ids, "count": len(ids), "max_model_len": serving.model_info.max_model_len}
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Serving) -> Response:
    serving.model_name(body.model)
    tokenizer = serving.require_tokenizer("tokens")
    if any(not 0 <= t < serving.model_info.vocab_size for t in body.tokens):
        raise OpenAIError("token ids out of vocabulary.", param="tokens")
    return json_response({"prompt": tokenizer.decode(body.tokens)})
