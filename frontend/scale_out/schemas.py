"""vLLM's tokens-in/tokens-out wire: GenerateRequest (a prompt's token ids and vLLM's SamplingParams as JSON)
and the fields of its answers. A field we do not implement is a 400 naming it unless its value asks for
nothing (vLLM's render sends every SamplingParams field, most at their defaults)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from frontend.openai.schemas import CompletionRequest, StreamOptions
from frontend.server.errors import OpenAIError

# vLLM SamplingParams fields that mean what our completions door's fields of the same names mean
SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "structured_outputs",
    "logit_bias", "allowed_token_ids", "bad_words",
})  # fmt: skip
# ... that we do not implement, each with the value that asks for nothing
UNIMPLEMENTED_SAMPLING = {
    "watermarking": None, "prompt_logprob_token_ids": None, "prompt_logprob_start": None,
    "flat_logprobs": False, "stream_interval": None, "output_text_buffer_length": 0,
    "extra_args": None, "skip_reading_prefix_cache": None, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0, "trace_decode_token_ids": None,
    "truncate_prompt_tokens": None,
}  # fmt: skip
# ... that change nothing here: vLLM's server sets output_kind from `stream`; skip_clone is its own copying
OVERRIDDEN_SAMPLING = frozenset({"output_kind", "skip_clone"})


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    # vLLM's fields for what we do not do yet: null (or absent) only
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    token_offsets: list[Any] | None = None

    def check_supported(self) -> None:
        refused = {
            "features": "multimodal features",
            "content_parts": "multimodal content parts",
            "ec_transfer_params": "encoder-cache transfer",
            "reasoning_ended": "the engine's reasoning gate for structured outputs",
            "reasoning_parser_kwargs": "the engine's reasoning gate for structured outputs",
        }
        for name, what in refused.items():
            if getattr(self, name) is not None:
                raise OpenAIError(f"{name} is not supported by this server: {what}.", param=name,
                                  code="unsupported_field")  # fmt: skip
        if any(t < 0 for t in self.token_ids):
            raise OpenAIError("token_ids must not contain negative values.", param="token_ids")

    def completion(self) -> tuple[CompletionRequest, bool]:
        """The completions body that computes the same (our one path for token prompts), and whether
        sampling_params.detokenize is on."""
        return completion_body(
            self.token_ids, self.sampling_params, model=self.model, stream=self.stream,
            stream_options=self.stream_options, cache_salt=self.cache_salt, priority=self.priority,
            kv_transfer_params=self.kv_transfer_params,
        )  # fmt: skip


def completion_body(
    prompt: list[int] | str, sampling_params: dict[str, Any], **request: Any
) -> tuple[CompletionRequest, bool]:
    """vLLM's sampling_params (by its names) over a prompt, as the completions body that computes the same,
    and whether sampling_params.detokenize is on; request: the body's other fields. The generate door's
    and the gRPC door's (frontend/grpc_door/)."""
    fields: dict[str, Any] = {}
    detokenize = True
    for name, value in sampling_params.items():
        if name == "logprob_token_ids":
            continue  # label_token_ids() reads it
        if name in SAMPLING_FIELDS:
            fields[name] = value
        elif name == "detokenize":
            if not isinstance(value, bool):
                raise OpenAIError(
                    "sampling_params.detokenize must be a boolean.", param="sampling_params.detokenize"
                )
            detokenize = value
        elif name in UNIMPLEMENTED_SAMPLING:
            if value != UNIMPLEMENTED_SAMPLING[name]:
                raise OpenAIError(f"sampling_params.{name} is not supported by this server.",
                                  param=f"sampling_params.{name}", code="unsupported_field")  # fmt: skip
        elif name not in OVERRIDDEN_SAMPLING:
            raise OpenAIError(f"sampling_params.{name} is not a sampling parameter.",
                              param=f"sampling_params.{name}")  # fmt: skip
    if not detokenize and fields.get("stop"):
        raise OpenAIError("stop strings need sampling_params.detokenize: use stop_token_ids.",
                          param="sampling_params.stop")  # fmt: skip
    fields.setdefault("max_tokens", None)  # vLLM's generate: the rest of the context
    try:
        body = CompletionRequest(prompt=prompt, **request, **fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(f"sampling_params.{where}: {first.get('msg', 'invalid')}",
                          param=f"sampling_params.{where}") from None  # fmt: skip
    return body, detokenize


def label_token_ids(sampling_params: dict[str, Any]) -> list[int] | None:
    """sampling_params.logprob_token_ids: the tokens whose logprobs each position reports (vLLM's)."""
    ids = sampling_params.get("logprob_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise OpenAIError("sampling_params.logprob_token_ids must be a list of token ids.",
                          param="sampling_params.logprob_token_ids")  # fmt: skip
    return ids


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str]
