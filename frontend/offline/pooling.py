"""The offline API of a pooling model: `LLM.embed()`, `.classify()`, `.score()` and `.encode()`, with
vLLM's result shapes (`output.outputs.embedding`, `.probs`, `.score`, `.data`)."""

from __future__ import annotations

import itertools
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from frontend.engine.async_llm import AsyncLLM, gather_all
from frontend.engine.data_parallel import EngineClient
from protocol.errors import InvalidParameterError
from protocol.messages import ModelInfo
from protocol.pooling import PoolingParams

Prompt = str | list[int] | dict[str, Any]
T = TypeVar("T")


class Host(Protocol):
    """What these methods use of the LLM they are mixed into (frontend/offline/llm.py)."""

    model: str
    model_info: ModelInfo
    engine_llm: AsyncLLM
    _counter: itertools.count[int]

    @property
    def client(self) -> EngineClient: ...

    def run(self, work: Coroutine[Any, Any, T]) -> T: ...

    def _require_tokenizer(self) -> Any: ...

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]: ...


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: np.ndarray  # the pooled value as the model gives it (a vector; [tokens, dim] for ALL pooling)


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: Any  # one of the outputs above
    finished: bool = True


class PoolingMethods:
    """Mixed into LLM: each method runs its inputs at once on the engine, results in order."""

    def embed(
        self: Host, prompts: Prompt | Sequence[Prompt], *, dimensions: int | None = None, normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:  # fmt: skip
        params = PoolingParams(task="embed", dimensions=dimensions, normalize=normalize)
        results = _pool(self, prompts, params, truncate_prompt_tokens)
        for result in results:
            result.outputs = EmbeddingOutput(result.outputs.data.tolist())
        return results

    def classify(
        self: Host, prompts: Prompt | Sequence[Prompt], *, activation: bool | None = None
    ) -> list[PoolingRequestOutput]:
        results = _pool(self, prompts, PoolingParams(task="classify", activation=activation), None)
        for result in results:
            result.outputs = ClassificationOutput(result.outputs.data.tolist())
        return results

    def encode(
        self: Host, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None
    ) -> list[PoolingRequestOutput]:
        params = pooling_params or PoolingParams(
            task=self.model_info.pooling_tasks[0] if self.model_info.pooling_tasks else "embed"
        )
        return _pool(self, prompts, params, None)

    def score(self: Host, queries: str | list[str], documents: str | list[str]) -> list[PoolingRequestOutput]:
        """Cosine similarity of embeddings, or a cross-encoder's score of each pair (as /score)."""
        first = [queries] if isinstance(queries, str) else list(queries)
        second = [documents] if isinstance(documents, str) else list(documents)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise InvalidParameterError("documents", "give one query, or one per document")
        tasks = self.model_info.pooling_tasks
        if "score" not in tasks:
            raise InvalidParameterError(
                "task", f"this model does not score; its tasks: {', '.join(tasks) or 'generate'}"
            )
        tokenizer = self._require_tokenizer()
        if "embed" in tasks:
            vectors = _pool(self, [*first, *second], PoolingParams(task="score", normalize=True), None)
            n = len(first)
            pairs = zip(vectors[:n], vectors[n:], strict=True)
            return [
                PoolingRequestOutput(
                    q.request_id,
                    q.prompt_token_ids + d.prompt_token_ids,
                    ScoringOutput(float(q.outputs.data @ d.outputs.data)),
                )
                for q, d in pairs
            ]
        prompts = []
        for query, document in zip(first, second, strict=True):
            encoded = tokenizer(query, document)
            types = list(encoded.get("token_type_ids") or [])
            prompts.append((list(encoded["input_ids"]), types.index(1) if 1 in types else None))
        results = self.run(
            gather_all(
                [
                    _pool_one(self, ids, PoolingParams(task="score", token_type_start=start))
                    for ids, start in prompts
                ]
            )
        )
        for result in results:
            result.outputs = ScoringOutput(float(result.outputs.data.reshape(-1)[0]))
        return results


def _pool(
    host: Host, prompts: Prompt | Sequence[Prompt], params: PoolingParams, truncate: int | None
) -> list[PoolingRequestOutput]:
    if host.model_info.runner != "pooling":
        raise InvalidParameterError("model", f"{host.model} generates: it does not embed, score or classify")
    ids_list = []
    if truncate is not None and not (truncate == -1 or truncate >= 1):
        raise InvalidParameterError("truncate_prompt_tokens", "must be -1 (the model's limit) or at least 1")
    keep = host.model_info.max_model_len if truncate == -1 else truncate
    for prompt in _prompt_list(prompts):
        if isinstance(prompt, str) and keep is not None:
            # the tokenizer's cut, as the HTTP doors make it (a BERT tokenizer keeps the end's [SEP])
            ids = list(host._require_tokenizer()(prompt, truncation=True, max_length=keep)["input_ids"])
        else:
            ids = host._tokenize(prompt)[1]
            if keep is not None:
                ids = ids[-keep:]  # token ids: the last k, as vLLM keeps them
        if not ids:
            raise InvalidParameterError("prompt", "the prompt is empty.")
        if len(ids) > host.model_info.max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"the input has {len(ids)} tokens; this model takes {host.model_info.max_model_len}",
            )
        ids_list.append(ids)
    return host.run(gather_all([_pool_one(host, ids, params) for ids in ids_list]))


async def _pool_one(host: Host, ids: list[int], params: PoolingParams) -> PoolingRequestOutput:
    request_id = f"{host.client.client_id}-{next(host._counter)}"
    pooled = await host.engine_llm.encode(request_id, ids, params)
    data = np.frombuffer(pooled.data, dtype="<f4").reshape(pooled.shape).copy()
    return PoolingRequestOutput(request_id, ids, PoolingOutput(data))


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, {"prompt_token_ids": ...}) or several, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [cast(list[int], list(prompts))]
    return list(cast(Sequence[Prompt], prompts))
