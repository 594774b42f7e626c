"""POST /tokenize and /detokenize (vLLM's), GET /v1/models and /v1/models/{model}, and GET /v1 (a base
URL's probe)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ValidationError

from frontend.openai.common import Serving, json_response
from frontend.openai.render import chat_prompt
from frontend.openai.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from frontend.openai.serving import OpenAIServing
from frontend.server.errors import OpenAIError
from frontend.vision.loader import chat_images

router = APIRouter()
V1_ENDPOINTS = ["/v1/models", "/v1/chat/completions", "/v1/completions"]


def model_card(serving: OpenAIServing, name: str) -> dict[str, Any]:
    info = serving.model_info
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "engine",
        "root": info.model,
        "max_model_len": info.max_model_len,
        # what the model does: vLLM's runner, and a pooling model's tasks (embed, score, classify)
        "runner": info.runner,
        "tasks": info.pooling_tasks if info.runner == "pooling" else ["generate"],
        "parent": None,
    }


def lora_card(serving: OpenAIServing, adapter: dict[str, Any]) -> dict[str, Any]:
    """vLLM's card of an adapter: its folder as `root`, the base model as `parent`."""
    base = adapter.get("base_model_name") or serving.model_info.served_model_names[0]
    return {**model_card(serving, adapter["name"]), "root": adapter["path"], "parent": base}


@router.get("/v1/models")
async def models(serving: Serving) -> Response:
    data = [model_card(serving, name) for name in serving.model_info.served_model_names]
    data += [lora_card(serving, adapter) for adapter in await serving.loras()]
    return json_response({"object": "list", "data": data})


# `:path`: a served name may hold slashes (a hub id such as Qwen/Qwen3-0.6B)
@router.get("/v1/models/{model:path}")
async def model(model: str, serving: Serving) -> Response:
    """OpenAI's retrieve: the model's card (a base name's or an adapter's), or 404 model_not_found."""
    if serving.lora_name(model) is not None:
        for adapter in await serving.loras():
            if adapter["name"] == model:
                return json_response(lora_card(serving, adapter))
        raise serving.not_found(model)
    return json_response(model_card(serving, serving.model_name(model)))


@router.get("/v1")
async def v1_root(serving: Serving) -> Response:
    """What clients that probe a base URL before use find: the server, its models, its doors."""
    return json_response(
        {
            "object": "api",
            "name": "engine",
            "version": serving.model_info.engine_version,
            "models": serving.model_info.served_model_names,
            "endpoints": V1_ENDPOINTS,
        }
    )


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Serving) -> Response:
    await serving.check_model(body.model)
    model = serving.model_name(body.model)
    if body.messages is not None:
        try:
            chat = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
        except ValidationError as error:  # the same checks as a chat request's messages (roles)
            first = error.errors()[0]
            raise OpenAIError(str(first.get("msg", "invalid messages")), param="messages") from error
        ids = chat_prompt(
            serving, chat, images=await chat_images(serving.images, model, chat.messages)
        ).token_ids
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
    await serving.check_model(body.model)
    serving.model_name(body.model)
    tokenizer = serving.require_tokenizer("tokens")
    if any(not 0 <= t < serving.model_info.vocab_size for t in body.tokens):
        raise OpenAIError("token ids out of vocabulary.", param="tokens")
    return json_response({"prompt": tokenizer.decode(body.tokens)})


# GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint: it shows the chat template)
info_router = APIRouter()


@info_router.get("/tokenizer_info")
async def tokenizer_info(serving: Serving) -> Response:
    """The tokenizer's settings as its tokenizer_config.json holds them (file paths left out), its class,
    and the chat template the server renders with."""
    tokenizer = serving.require_tokenizer("tokenizer")
    config = {k: v for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}  # fmt: skip
    config = _plain(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = serving.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return json_response(config)


def _plain(value: Any) -> Any:
    """JSON values: an added token as its text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
