"""Request -> SamplingParams: OpenAI and vLLM fields, the model's generation-config defaults and the
context limit, validated once with the field's name in every error."""

from __future__ import annotations

from typing import Any

from frontend.openai.schemas import SamplingFields
from frontend.server.errors import OpenAIError
from protocol.errors import InvalidParameterError
from protocol.messages import ModelInfo
from protocol.sampling import MAX_LOGPROBS, SamplingParams
from protocol.structured_outputs import StructuredOutputsParams


def check_top(value: int | None, param: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}.", param=param)
    return value


def truncate_prompt(ids: list[int], request: SamplingFields, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: keep the last k tokens (-1: the model's limit), as vLLM does."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def bad_words_token_ids(words: list[str] | None, tokenizer: Any) -> list[list[int]]:
    """Each bad word as token ids, at the start of a text and after a space (vLLM's rule: the spaced
    form counts only when it is a different first token of the same length)."""
    if not words:
        return []
    if tokenizer is None:
        raise OpenAIError("bad_words needs a tokenizer; this model has none.", param="bad_words")
    result: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise OpenAIError("bad words must not be empty.", param="bad_words")
        plain = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        for ids in (plain, spaced):
            if (
                ids
                and ids not in result
                and (ids is plain or (ids[0] != plain[0] and len(ids) == len(plain)))
            ):
                result.append(ids)
    return result


def to_sampling_params(
    request: SamplingFields,
    *,
    model_info: ModelInfo,
    defaults: dict[str, Any],
    tokenizer: Any,
    num_prompt_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    prompt_param: str,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    limit = model_info.max_model_len
    if max_tokens is None and "max_tokens" in defaults:
        max_tokens = min(int(defaults["max_tokens"]), max(limit - num_prompt_tokens, 1))
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if num_prompt_tokens + (max_tokens or 0) > limit or num_prompt_tokens >= limit:
        raise OpenAIError(
            # vLLM's wording, "messages" for either door: clients match on it.
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + (max_tokens or 0)} tokens ({num_prompt_tokens} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the messages or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        bias = {int(k): float(v) for k, v in (request.logit_bias or {}).items()}
    except ValueError as error:
        raise OpenAIError("logit_bias keys must be token ids.", param="logit_bias") from error

    def pick(value: Any, name: str, fallback: Any) -> Any:
        """The request's value, else the generation config's, else the OpenAI default."""
        return value if value is not None else defaults.get(name, fallback)

    params = SamplingParams(
        n=request.n,
        temperature=pick(request.temperature, "temperature", 1.0),
        top_p=pick(request.top_p, "top_p", 1.0),
        top_k=pick(request.top_k, "top_k", 0),
        min_p=pick(request.min_p, "min_p", 0.0),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=pick(request.repetition_penalty, "repetition_penalty", 1.0),
        logit_bias=bias or None,
        max_tokens=max_tokens if max_tokens is not None else limit - num_prompt_tokens,
        min_tokens=request.min_tokens,
        stop=stop,
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=check_top(prompt_logprobs, "prompt_logprobs"),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        allowed_token_ids=request.allowed_token_ids,
        bad_words_token_ids=bad_words_token_ids(request.bad_words, tokenizer),
        structured_outputs=structured_outputs,
    )
    try:
        params.validate(model_info.vocab_size)
    except InvalidParameterError as error:
        raise OpenAIError(error.message, param=error.param) from error
    return params
