"""More pooling through the public interfaces: a sequence classifier and a cross-encoder (tiny random
BERTs with MiniLM's tokenizer) over HTTP against transformers; `engine run-batch` answering embeddings,
score and rerank lines with the same values as the server; MEAN pooling of a causal LM over prefill
chunks; a Matryoshka size set with --pooler-config."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from frontend import LLM
from tests.serve_helpers import Served, serving
from tests.test_llm_pooling import TEXTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def classifier_server(classifiers) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    with serving(str(classifiers["classifier"])) as served:
        yield served


@pytest.fixture(scope="module")
def cross_encoder_server(classifiers) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    with serving(str(classifiers["cross-encoder"])) as served:
        yield served


def test_classify_over_http(classifier_server: Served, classifiers) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = classifiers["classifier"]
    tokenizer, hf = (
        AutoTokenizer.from_pretrained(folder),
        BertForSequenceClassification.from_pretrained(folder),
    )
    answer = httpx.post(f"{classifier_server.base}/classify", json={"input": TEXTS}).json()
    for text, item in zip(TEXTS, answer["data"], strict=True):
        with torch.inference_mode():
            expected = torch.softmax(hf(**tokenizer(text, return_tensors="pt")).logits[0], -1).numpy()
        np.testing.assert_allclose(item["probs"], expected, atol=1e-5)
        assert item["num_classes"] == 3 and item["label"] == hf.config.id2label[int(np.argmax(expected))]
    raw = httpx.post(
        f"{classifier_server.base}/classify", json={"input": TEXTS[0], "use_activation": False}
    ).json()
    with torch.inference_mode():
        logits = hf(**tokenizer(TEXTS[0], return_tensors="pt")).logits[0].numpy()
    np.testing.assert_allclose(raw["data"][0]["probs"], logits, atol=1e-5)  # vLLM's name: no softmax
    for path in ("/v1/embeddings", "/score", "/rerank"):  # a 3-label classifier scores no pairs
        response = httpx.post(
            f"{classifier_server.base}{path}", json={"input": "x", "query": "q", "documents": ["d"]}
        )
        assert response.status_code == 404 and "its tasks: classify" in response.json()["error"]["message"]


def test_cross_encoder_scores_and_rerank_over_http(cross_encoder_server: Served, classifiers) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = classifiers["cross-encoder"]
    tokenizer, hf = (
        AutoTokenizer.from_pretrained(folder),
        BertForSequenceClassification.from_pretrained(folder),
    )
    query, documents = TEXTS[0], TEXTS[1:]
    with torch.inference_mode():
        expected = np.array(
            [
                torch.sigmoid(hf(**tokenizer(query, d, return_tensors="pt")).logits[0, 0]).item()
                for d in documents
            ]
        )
    scores = httpx.post(
        f"{cross_encoder_server.base}/v1/score", json={"queries": query, "documents": documents}
    )
    np.testing.assert_allclose([d["score"] for d in scores.json()["data"]], expected, atol=1e-5)
    ranked = httpx.post(
        f"{cross_encoder_server.base}/v2/rerank",
        json={"query": query, "documents": [{"text": d} for d in documents], "return_documents": False},
    ).json()
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(-expected))
    assert all("document" not in r for r in ranked["results"])
    # max_tokens_per_doc cuts each document, never the query
    cut = httpx.post(
        f"{cross_encoder_server.base}/rerank",
        json={"query": query, "documents": documents, "max_tokens_per_doc": 2},
    ).json()
    with torch.inference_mode():
        for result in cut["results"]:
            document = tokenizer(documents[result["index"]], add_special_tokens=False)["input_ids"][:2]
            pair = tokenizer(query, tokenizer.decode(document), return_tensors="pt")
            expected_cut = torch.sigmoid(hf(**pair).logits[0, 0]).item()
            np.testing.assert_allclose(result["relevance_score"], expected_cut, atol=1e-5)


def test_run_batch_answers_pooling_lines(minilm: str, tmp_path: pathlib.Path) -> None:
    from sentence_transformers import SentenceTransformer

    lines = [
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": TEXTS[:2]}},
        {"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"queries": TEXTS[0], "documents": TEXTS[1:3]}},
        {"custom_id": "r", "method": "POST", "url": "/rerank", "body": {"query": TEXTS[0], "documents": TEXTS[1:]}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
    ]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [
        sys.executable,
        "-m",
        "frontend.cli",
        "run-batch",
        minilm,
        "-i",
        str(source),
        "-o",
        str(target),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    vectors = SentenceTransformer(minilm, device="cpu").encode(TEXTS, normalize_embeddings=True)
    embedded = np.array([d["embedding"] for d in records["e"]["response"]["body"]["data"]])
    assert (embedded * vectors[:2]).sum(1).min() >= 0.99999
    scores = [d["score"] for d in records["s"]["response"]["body"]["data"]]
    np.testing.assert_allclose(scores, vectors[1:3] @ vectors[0], atol=1e-5)
    order = [r["index"] for r in records["r"]["response"]["body"]["results"]]
    assert order == list(np.argsort(-(vectors[1:] @ vectors[0])))
    assert (
        records["c"]["response"]["status_code"] == 404
        and records["c"]["error"]["code"] == "model_task_not_supported"
    )


def test_mean_pooling_over_prefill_chunks_and_a_matryoshka_size(
    smollm2_gguf: str, minilm: str, hf_smollm2
) -> None:  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    hf = hf_smollm2
    mean = {"pooling_type": "MEAN", "normalize": True}
    # 16-token chunks: every text of over 16 tokens is pooled across chunks
    with LLM(
        smollm2_gguf, convert="embed", dtype="float32", pooler_config=mean, long_prefill_token_threshold=16
    ) as llm:
        assert not llm.model_info.enable_prefix_caching  # MEAN needs every row
        results = llm.embed(TEXTS)
    assert max(len(r.prompt_token_ids) for r in results) > 16
    for result in results:
        with torch.inference_mode():
            hidden = hf(torch.tensor([result.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][
                0
            ]
        expected = torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy()
        assert float(np.dot(result.outputs.embedding, expected)) >= 0.99999
    full = SentenceTransformer(minilm, device="cpu").encode(TEXTS)
    with LLM(minilm, pooler_config={"matryoshka_dimensions": [128]}) as llm:
        short = np.array([r.outputs.embedding for r in llm.embed(TEXTS, dimensions=128)])
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    assert short.shape == (len(TEXTS), 128) and (short * expected).sum(1).min() >= 0.99999


def test_mean_pooling_survives_preemption(smollm2_gguf: str) -> None:
    """A pool of 4 blocks (256 tokens) for 8 inputs of ~60-120 tokens in 16-token chunks: requests are
    preempted mid-prefill and resumed from scratch; each vector equals the one computed alone."""
    texts = [" ".join(["the sea is calm and blue tonight"] * (8 + 2 * i)) + f" {i}" for i in range(8)]
    flags = dict(convert="embed", dtype="float32", pooler_config={"pooling_type": "MEAN"}, max_model_len=256)
    with LLM(smollm2_gguf, num_kv_blocks=4, long_prefill_token_threshold=16, **flags) as llm:
        together = [r.outputs.embedding for r in llm.embed(texts)]
        preemptions = llm.get_stats()["num_preemptions"]
        alone = [llm.embed(text)[0].outputs.embedding for text in texts]
    assert preemptions > 0
    assert together == alone  # the same bits: the rows of a preempted request were dropped and redone
