"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`.

It runs the real processes (an EngineCore process and its worker) and speaks to them over ZMQ, as
an API server does, so tests and benchmarks drive the same engine that `engine serve` runs.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from frontend.detokenizer import IncrementalDetokenizer
from frontend.engine_args import EngineArgs
from frontend.engine_client import EngineClient
from frontend.engine_process import EngineProcess
from frontend.model_files import load_tokenizer
from frontend.outputs import CompletionOutput, Logprob, RequestResult
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.messages import AddRequest, EngineDead, EngineOutputs, Logprobs, ModelInfo, RequestOutput
from protocol.sampling import SamplingParams

logger = logging.getLogger("engine.llm")

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


@dataclass
class _Child:
    """One engine request: completion `index` of `result`."""

    result: RequestResult
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    logprobs: list[dict[int, Logprob]] | None = field(default=None)


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.args = EngineArgs(model=model, **engine_args)
        config = self.args.engine_config()
        self.model = config.worker.model
        self.engine = EngineProcess(config)
        # Stop the engine even when the caller forgets shutdown() (or the interpreter exits).
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        try:
            self.tokenizer = load_tokenizer(self.model, self.args.tokenizer_cache_dir)
            self.client = EngineClient(config.input_address, config.output_address)
            self.model_info: ModelInfo = self.client.register(
                self.args.startup_timeout_s, self.engine.is_alive
            )
        except BaseException:
            self.engine.shutdown()
            raise
        self._counter = itertools.count()

    # ---- public API ----

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: list[int] | None = None,
    ) -> list[RequestResult]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}); results in order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        priorities = priority or [0] * len(prompt_list)
        return self._run([self._tokenize(p) for p in prompt_list], params_list, priorities)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestResult]:
        """Apply the model's chat template to each conversation and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(
                conversation,  # type: ignore[arg-type]
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)  # type: ignore[arg-type]

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> dict[str, Any]:
        tokenizer = self._require_tokenizer()
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt": text, "prompt_token_ids": ids}

    def reset_prefix_cache(self) -> bool:
        return bool(self.client.call_utility("reset_prefix_cache"))

    def get_stats(self) -> dict[str, Any]:
        return dict(self.client.call_utility("get_stats"))

    def check_invariants(self) -> bool:
        return bool(self.client.call_utility("check_invariants"))

    def shutdown(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
            self.client = None  # type: ignore[assignment]
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: Any) -> None:
        self.shutdown()

    # ---- internals ----

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidParameterError("prompt", f"{self.model} has no tokenizer: pass prompt token ids")
        return self.tokenizer

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer()(prompt)["input_ids"]
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._tokenize(prompt["prompt"])
        return None, list(prompt)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        priorities: list[int],
    ) -> list[RequestResult]:
        info = self.model_info
        children: dict[str, _Child] = {}
        results = []
        for (text, ids), params, priority in zip(prompts, params_list, priorities, strict=True):
            params.validate(info.vocab_size)
            if not ids:
                raise InvalidParameterError("prompt", "the prompt is empty.")
            max_tokens = params.max_tokens or 0
            if len(ids) + max_tokens > info.max_model_len:
                raise InvalidParameterError(
                    "max_tokens",
                    f"this model's maximum context length is {info.max_model_len} tokens; the prompt has "
                    f"{len(ids)} and max_tokens is {max_tokens}.",
                )
            result = RequestResult(f"{self.client.client_id}-{next(self._counter)}", text, ids)
            results.append(result)
            for index in range(params.n):
                output = CompletionOutput(
                    index, "", [], None, logprobs=[] if params.logprobs is not None else None
                )
                result.outputs.append(output)
                child_id = f"{result.request_id}-{index}"
                children[child_id] = _Child(
                    result, output, IncrementalDetokenizer(self.tokenizer, params), params
                )
                self.client.add_request(
                    AddRequest(
                        request_id=child_id,
                        prompt_token_ids=ids,
                        sampling_params=params.for_choice(index),
                        arrival_time=time.time(),
                        priority=priority,
                    )
                )
        try:
            self._wait(children)
        except BaseException:
            self.client.abort_requests([cid for cid, c in children.items() if c.output.finish_reason is None])
            raise
        return results

    def _wait(self, children: dict[str, _Child]) -> None:
        remaining = set(children)
        while remaining:
            message = self.client.receive(timeout_s=1.0)
            if message is None:
                if not self.engine.is_alive():
                    raise EngineDeadError("the engine process exited")
                continue
            if isinstance(message, EngineDead):
                raise EngineDeadError(message.reason)
            if not isinstance(message, EngineOutputs):
                continue
            for request_output in message.outputs:
                child = children.get(request_output.request_id)
                if child is None or request_output.request_id not in remaining:
                    continue
                if self._apply(child, request_output):
                    remaining.discard(request_output.request_id)

    def _apply(self, child: _Child, out: RequestOutput) -> bool:
        """Fold one step's output into the child; True when it is finished."""
        output = child.output
        if out.finish_reason == "abort" and isinstance(out.stop_reason, str) and not out.new_token_ids:
            raise InvalidParameterError("prompt", f"the engine rejected the request: {out.stop_reason}")
        output.token_ids.extend(out.new_token_ids)
        child.result.num_cached_tokens = out.num_cached_tokens
        if out.new_logprobs is not None and output.logprobs is not None:
            output.logprobs.extend(_logprob_dicts(out.new_logprobs))
            output.cumulative_logprob = sum(next(iter(d.values())).logprob for d in output.logprobs)
        if out.new_prompt_logprobs is not None and child.output.index == 0:
            result = child.result
            if result.prompt_logprobs is None:
                result.prompt_logprobs = [None]
            result.prompt_logprobs.extend(_logprob_dicts(out.new_prompt_logprobs))
        child.detokenizer.update(out.new_token_ids, finished=out.finish_reason is not None)
        output.text = child.detokenizer.text
        if child.detokenizer.stop_matched is not None and out.finish_reason is None:
            self.client.abort_requests([out.request_id])
            output.finish_reason, output.stop_reason = "stop", child.detokenizer.stop_matched
            return True
        if out.finish_reason is not None:
            output.finish_reason = out.finish_reason
            if child.detokenizer.stop_matched is not None:
                output.finish_reason, output.stop_reason = "stop", child.detokenizer.stop_matched
            else:
                output.stop_reason = out.stop_reason
            return True
        return False


def _logprob_dicts(logprobs: Logprobs) -> list[dict[int, Logprob]]:
    result = []
    for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks, strict=True):
        entry = {ids[0]: Logprob(values[0], rank)}
        for position, (token_id, value) in enumerate(zip(ids[1:], values[1:], strict=True)):
            entry.setdefault(token_id, Logprob(value, position + 1))
        result.append(entry)
    return result


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _broadcast(value: SamplingParams | list[SamplingParams], count: int, name: str) -> list[SamplingParams]:
    if isinstance(value, SamplingParams):
        return [value] * count
    if len(value) != count:
        raise InvalidParameterError(name, f"{len(value)} {name} for {count} prompts")
    return list(value)
