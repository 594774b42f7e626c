"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`.

It runs the real processes (an EngineCore process and its worker) and speaks to them through the same
AsyncLLM an API server uses (one engine client, one output processor), on an event loop of its own,
so tests and benchmarks drive the same engine and the same output path that `engine serve` runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from frontend.config.engine_args import EngineArgs
from frontend.engine.async_llm import AsyncLLM, final_state, gather_all
from frontend.engine.data_parallel import EngineClient, connect_engines
from frontend.engine.output_processor import RequestState
from frontend.engine.process import EngineGroup, EngineRefusedError
from frontend.model_files import load_tokenizer
from frontend.offline.lora import LoraLoader, LoRARequest
from frontend.offline.outputs import CompletionOutput, Logprob, RequestResult
from frontend.offline.pooling import PoolingMethods
from frontend.offline.transcription import TranscriptionMethods
from frontend.offline.vision import VisionChat
from frontend.vision.parts import message_images
from protocol.errors import InvalidParameterError
from protocol.media import MultiModalInput
from protocol.messages import Logprobs, ModelInfo
from protocol.sampling import SamplingParams
from structured_outputs import backend_class

logger = logging.getLogger("engine.llm")

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]
T = TypeVar("T")

ENGINE_POLL_S = 0.5  # how often a running call checks that the engine process is alive


class LLM(PoolingMethods, TranscriptionMethods):
    def __init__(
        self, model: str | None = None, *, allowed_local_media_path: str | None = None, **engine_args: Any
    ) -> None:
        """allowed_local_media_path: the folder whose files chat() image parts may name as file:// URLs."""
        self.allowed_local_media_path = allowed_local_media_path
        self._vision: VisionChat | None = None  # made by the first chat() with images
        self.args = EngineArgs(model=model, **engine_args)
        config = self.args.engine_config()
        self.model = config.worker.model
        self.engine = EngineGroup(config, self.args.data_parallel_size, self.args.data_parallel_local_ranks)
        config = self.engine.config
        self._loop = asyncio.new_event_loop()
        # Stop the engine even when the caller forgets shutdown() (or the interpreter exits).
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._client: EngineClient | None = None
        try:
            self.tokenizer = load_tokenizer(config.worker.tokenizer or self.model, self.args.cache_dir)
            self.model_info: ModelInfo = self._call(self._start(config.input_address, config.output_address))
        except BaseException as error:
            reason = self.engine.refusal()
            self.shutdown()
            if reason is not None:  # the model or a setting: what the engine said, not a dead engine
                raise EngineRefusedError(reason) from error
            raise
        self._counter = itertools.count()
        self._loras = LoraLoader()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An LLM from parsed flags (`engine generate`, `engine bench throughput|latency`)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    async def _start(self, input_address: str, output_address: str) -> ModelInfo:
        self._client = await connect_engines(
            input_address, output_address, None, self.args.startup_timeout_s, self.engine.is_alive
        )
        self.engine_llm = AsyncLLM(self._client, self.tokenizer)
        assert self._client.model_info is not None
        return self._client.model_info

    # ---- public API ----

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestResult]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}); results in order.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model); loaded into
        the engine (needs enable_lora=True) on first use."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"lora_request: {len(loras)} for {len(prompt_list)} prompts")
        priorities = priority or [0] * len(prompt_list)
        prompts_ids = [self._tokenize(p) for p in prompt_list]
        for (_, ids), params in zip(prompts_ids, params_list, strict=True):
            self._validate(ids, params)
        return self._call(self._run_all(prompts_ids, params_list, priorities, loras))

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
        """Apply the model's chat template to each conversation and generate. A vision-language model's
        conversations may hold image parts (image_url: data, http(s), or file:// under
        allowed_local_media_path), as the chat door takes them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if any(message_images(conversation) for conversation in conversations):  # type: ignore[arg-type]
            template = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt and not
                            continue_final_message, continue_final_message=continue_final_message,
                            **(chat_template_kwargs or {}))  # fmt: skip
            params = _broadcast(sampling_params or SamplingParams(), len(conversations), "sampling_params")
            return self._call(self._chat_images(conversations, params, template))  # type: ignore[arg-type]
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

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the caller's on this LLM's event loop, beside its engine client (`engine
        run-batch` drives the API server's app there), the engine watched as generate() watches it."""
        return self._call(work)

    def reset_prefix_cache(self) -> bool:
        return bool(self._utility("reset_prefix_cache"))

    def get_stats(self) -> dict[str, Any]:
        return dict(self._utility("get_stats"))

    def check_invariants(self) -> bool:
        return bool(self._utility("check_invariants"))

    def shutdown(self) -> None:
        if self._vision is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._vision.close())
            self._vision = None
        if self._client is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._client.aclose())
        self._client = None
        if not self._loop.is_closed():
            self._loop.close()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: Any) -> None:
        self.shutdown()

    # ---- internals ----

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("this LLM is shut down")
        return self._client

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on our loop while watching the engine process; an interrupt (Ctrl-C) cancels it,
        which aborts its engine requests."""
        task = self._loop.create_task(work)
        watcher = self._loop.create_task(self._watch_engine())
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            raise
        finally:
            watcher.cancel()
            self._loop.run_until_complete(asyncio.gather(watcher, return_exceptions=True))

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_POLL_S)
            if not self.engine.is_alive() and self._client is not None:
                self._client.mark_dead("the engine process exited")

    def _utility(self, method: str) -> Any:
        return self._call(self.client.call_utility(method, timeout_s=60.0))

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

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        info = self.model_info
        params.validate(info.vocab_size)
        if params.structured_outputs is not None:
            backend_class(info.structured_outputs_backend).validate(params.structured_outputs)
        if not ids:
            raise InvalidParameterError("prompt", "the prompt is empty.")
        max_tokens = params.max_tokens or 0
        if len(ids) + max_tokens > info.max_model_len:
            raise InvalidParameterError(
                "max_tokens",
                f"this model's maximum context length is {info.max_model_len} tokens; the prompt has "
                f"{len(ids)} and max_tokens is {max_tokens}.",
            )

    async def _run_all(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestResult]:
        names: list[str | None] = []
        for lora in loras or [None] * len(prompts):
            base = self.model_info.served_model_names[0]
            names.append(None if lora is None else await self._loras.ensure(self.client, lora, base))
        return await gather_all(
            [
                self._run_one(text, ids, params, priority, name)
                for (text, ids), params, priority, name in zip(
                    prompts, params_list, priorities, names, strict=True
                )
            ]
        )

    async def _chat_images(
        self, conversations: list[list[Message]], params_list: list[SamplingParams], template: dict[str, Any]
    ) -> list[RequestResult]:
        if self._vision is None:
            self._vision = VisionChat(self.model, self.model_info, self.allowed_local_media_path)
        tokenizer = self._require_tokenizer()
        rendered = [await self._vision.render(tokenizer, c, **template) for c in conversations]
        for (_, ids, _), params in zip(rendered, params_list, strict=True):
            self._validate(ids, params)
        return await gather_all([self._run_one(text, ids, params, 0, None, items)
                                 for (text, ids, items), params in zip(rendered, params_list, strict=True)])  # fmt: skip

    async def _run_one(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        lora_name: str | None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> RequestResult:
        request_id = f"{self.client.client_id}-{next(self._counter)}"
        stream = self.engine_llm.generate(request_id, ids, params, priority=priority, lora_name=lora_name,
                                          mm_inputs=mm_inputs)  # fmt: skip
        state = await final_state(stream)
        return _result(state, text)


def _result(state: RequestState, text: str | None) -> RequestResult:
    result = RequestResult(state.request_id, text, state.prompt_token_ids)
    result.num_cached_tokens = state.num_cached_tokens
    if state.prompt_logprobs is not None:
        result.prompt_logprobs = [None, *_logprob_dicts(state.prompt_logprobs)]
    for choice in state.choices:
        logprobs = None if choice.logprobs is None else _logprob_dicts(choice.logprobs)
        result.outputs.append(
            CompletionOutput(
                choice.index,
                choice.text,
                choice.token_ids,
                choice.finish_reason,
                choice.stop_reason,
                logprobs,
                None if logprobs is None else sum(next(iter(d.values())).logprob for d in logprobs),
            )
        )
    return result


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
