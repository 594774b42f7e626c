"""OpenAI request bodies (pydantic, as FastAPI validates them), with vLLM's extensions.

No field is accepted and ignored: a field declared here is implemented; a field OpenAI or vLLM defines
that we do not implement is listed in UNSUPPORTED_FIELDS and answered with 400 naming it; declared
fields we implement only in part (tools, response_format, best_of, ...) are checked by
`check_supported()`. Fields neither OpenAI nor vLLM defines are ignored with a debug line, as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from frontend.server.errors import OpenAIError

logger = logging.getLogger("engine.api")

ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Fields OpenAI or vLLM defines and we do not implement yet (the issue that brings each, where planned).
UNSUPPORTED_FIELDS = {
    "audio": "audio output",
    "modalities": "output modalities",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "verbosity": "verbosity",
    "reasoning_effort": "reasoning settings (not yet)",
    "length_penalty": "beam search",
    "logits_processors": "custom logits processors",
    "vllm_xargs": "extra engine arguments",
    "mm_processor_kwargs": "multimodal inputs",
    "media_io_kwargs": "multimodal inputs",
    "documents": "documents in the chat template",
    "prompt_embeds": "prompt embeddings",
    "thinking_token_budget": "reasoning settings (not yet)",
}
# Request metadata that changes no output: accepted (and logged at debug level).
METADATA_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions requests (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema, structural_tag
    # extensions, as in vLLM
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None  # like X-Request-Id: echoed and logged, never the engine's key
    # structured outputs (frontend/openai/structured.py): vLLM's object, and its legacy fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    guided_decoding_backend: str | None = None  # must name the engine's backend (or be "auto")
    guided_whitespace_pattern: str | None = None
    # disaggregated prefill and decode (docs/scale-out.md): vLLM's, passed to the engine, which checks it
    kv_transfer_params: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """400 for any field we do not implement, or a value of one that we implement only in part."""
        check_fields(self, UNSUPPORTED_FIELDS)
        if self.use_beam_search:
            raise unsupported("use_beam_search", "beam search")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        if self.store:
            raise unsupported("store", "storing completions")
        check_one_of("service_tier", self.service_tier, (None, "auto", "default"))
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true.", param="stream_options")
        check_truncation_and_salt(self.truncate_prompt_tokens, self.cache_salt)
        check_kv_transfer(self.kv_transfer_params, self.n, self.stream)


def check_kv_transfer(params: dict[str, Any] | None, n: int, stream: bool) -> None:
    """A request that produces or loads remote KV runs one choice; a producer's answer carries the params."""
    if params is None:
        return
    if n != 1:
        raise OpenAIError("kv_transfer_params takes n == 1.", param="kv_transfer_params")
    if stream and params.get("do_remote_decode"):
        raise OpenAIError(
            "a request with do_remote_decode answers with the decode's kv_transfer_params: send it with stream "
            "false.",
            param="kv_transfer_params",
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    function_call: str | dict[str, Any] | None = None  # legacy: maps onto tool_choice
    functions: list[dict[str, Any]] | None = None  # legacy: maps onto tools
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the response
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes the special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}.")
        return messages

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo", "echo in chat completions")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs to be true.", param="top_logprobs")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")


class TokenizeRequest(BaseModel):
    # vLLM's other tokenize fields (tools, return_token_strs, ...) are not ours yet: 400, not ignored
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """Another door's request in the chat form (its one rendering path), checked as a chat body is."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(f"{location}: {first.get('msg', 'invalid request')}", param=location) from error


def unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(
        f"{param} is not supported by this server: {what}.", param=param, code="unsupported_field"
    )


def check_fields(
    body: BaseModel,
    not_implemented: dict[str, str],
    *,
    asks_nothing: tuple[Any, ...] = (None,),
    passing: tuple[str, ...] = (),
) -> None:
    """Every door's scan of the fields its body does not declare: one its API (or vLLM) defines that we
    do not implement (`not_implemented`: name -> what it asks for) is a 400 naming it, unless its value
    asks for nothing (an explicit null; a door may add more, such as false); the `passing` fields change
    no output and pass; any other unknown field is ignored with a debug line, as vLLM does."""
    extra = body.model_extra or {}
    for name in sorted(extra):
        if name in not_implemented:
            if extra[name] not in asks_nothing:
                raise unsupported(name, not_implemented[name])
        elif name not in passing:
            logger.debug("ignoring the unknown request field %r", name)


def check_truncation_and_salt(truncate_prompt_tokens: int | None, cache_salt: str | None) -> None:
    """Two vLLM extensions every door that renders prompts shares (generation and pooling)."""
    if truncate_prompt_tokens is not None and not (
        truncate_prompt_tokens == -1 or truncate_prompt_tokens >= 1
    ):
        raise OpenAIError(
            "truncate_prompt_tokens must be -1 (the model's limit) or at least 1.",
            param="truncate_prompt_tokens",
        )
    if cache_salt is not None and not cache_salt:
        raise OpenAIError("cache_salt must not be empty.", param="cache_salt")


def check_one_of(param: str, value: Any, implemented: tuple[Any, ...]) -> None:
    """A declared field we implement for some values only (a service tier, a truncation mode)."""
    if value not in implemented:
        raise unsupported(param, f"{param.replace('_', ' ')} {value!r}")
