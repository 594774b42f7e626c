"""POST /score, /v1/score (vLLM's) and /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shapes).

With an embedding model a score is the cosine similarity of the two texts' embeddings (each distinct
text embedded once); with a cross-encoder (a sequence classifier of one label) it is the model's score
of the pair, run as one input (the second text with token type 1), through a sigmoid unless
`activation` is false.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.engine.async_llm import new_request_id
from frontend.openai.common import Serving, json_response
from frontend.openai.serving import OpenAIServing
from frontend.pooling.schemas import MAX_INPUTS, PoolingFields, RerankRequest, ScoreRequest
from frontend.pooling.serving import PoolingPrompt, check_task, envelope, pool_all, render_one, usage
from frontend.server.errors import OpenAIError
from protocol.pooling import PoolingParams

router = APIRouter()


async def scores(
    serving: OpenAIServing,
    queries: list[str],
    documents: list[str],
    body: PoolingFields,
    activation: bool | None,
    request: Request,
    doc_tokens: int | None = None,
) -> tuple[list[float], list[PoolingPrompt]]:
    """One score per (query, document) pair, and the prompts that ran (for usage). doc_tokens: each
    document's cut (rerank's max_tokens_per_doc), the queries left whole."""
    check_task(serving, "score", "scores")
    if len(documents) > MAX_INPUTS:
        raise OpenAIError(
            f"at most {MAX_INPUTS} documents per request, got {len(documents)}.", param="documents"
        )
    if "embed" in serving.model_info.pooling_tasks:
        # each distinct text once; a document cut by doc_tokens is another input than the same query
        keys = list(dict.fromkeys([*((q, None) for q in queries), *((d, doc_tokens) for d in documents)]))
        prompts = [
            render_one(serving, text, body, "queries" if cut is None else "documents", doc_tokens=cut)
            for text, cut in keys
        ]
        _, vectors = await pool_all(
            serving, prompts, PoolingParams(task="score", normalize=True), body, "score", request
        )
        by_key = dict(zip(keys, vectors, strict=True))
        pairs = zip(queries, documents, strict=True)
        return [float(by_key[(q, None)] @ by_key[(d, doc_tokens)]) for q, d in pairs], prompts
    prompts = [
        render_one(serving, q, body, "queries", pair=d, doc_tokens=doc_tokens)
        for q, d in zip(queries, documents, strict=True)
    ]
    _, values = await pool_all(
        serving, prompts, PoolingParams(task="score", activation=activation), body, "score", request
    )
    return [float(value.reshape(-1)[0]) for value in values], prompts


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request, serving: Serving) -> Response:
    check_task(serving, "score", "scores")
    body.check_supported()
    model = serving.model_name(body.model)
    queries, documents = body.pairs()
    values, prompts = await scores(serving, queries, documents, body, body.activation_of(), request)
    data = [{"index": i, "object": "score", "score": value} for i, value in enumerate(values)]
    return json_response(envelope(body.request_id or new_request_id("score"), model, data, prompts))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request, serving: Serving) -> Response:
    check_task(serving, "score", "reranking")
    body.check_supported()
    model = serving.model_name(body.model)
    if not body.query:
        raise OpenAIError("query must not be empty.", param="query")
    texts = body.texts()
    if not texts:
        raise OpenAIError("documents must not be empty.", param="documents")
    queries = [body.query] * len(texts)
    values, prompts = await scores(
        serving, queries, texts, body, body.activation_of(), request, body.max_tokens_per_doc
    )
    order = sorted(range(len(texts)), key=lambda i: -values[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, object] = {"index": i, "relevance_score": values[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    tokens = usage(prompts)["total_tokens"]
    return json_response(
        {
            "id": body.request_id or new_request_id("rerank"),
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
    )
