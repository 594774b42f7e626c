"""The offline pooling API (`LLM.embed`, `.classify`, `.score`, `.encode`) on real processes: MiniLM in
bf16 against sentence-transformers in float32, SmolLM2 as an embedder (LAST, normalized) against HF
transformers' last hidden state, and tiny random classifiers (3 labels; a 1-label cross-encoder) with
MiniLM's tokenizer against transformers' own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from frontend import LLM
from protocol.errors import InvalidParameterError
from protocol.pooling import PoolingParams
from tests.test_serve_pooling import texts

pytestmark = pytest.mark.slow

TEXTS = ["rain falls on paris", "Hello, world!", "naïve café — 東京の雨", "a fox " * 60]


def test_minilm_in_bf16_against_sentence_transformers(minilm: str) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(minilm, device="cpu").encode(TEXTS)
    with LLM(minilm, dtype="bfloat16") as llm:
        got = np.array([r.outputs.embedding for r in llm.embed(TEXTS)])
        assert llm.model_info.dtype == "bfloat16"
        scores = [r.outputs.score for r in llm.score(TEXTS[0], TEXTS[1:])]
        raw = llm.encode(TEXTS[:1], PoolingParams(normalize=False))[0].outputs.data
        long = texts()[-1]  # 400 random words: cut where the oracle cuts (its first 256 tokens)
        cut = np.array(llm.embed(long, truncate_prompt_tokens=256)[0].outputs.embedding)
        with pytest.raises(InvalidParameterError, match="pooling model"):
            llm.generate("hi")
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.999
    np.testing.assert_allclose(scores, expected[1:] @ expected[0], atol=5e-3)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3  # not normalized when asked not to be
    oracle = SentenceTransformer(minilm, device="cpu").encode([long])[0]
    assert float(cut @ oracle) / np.linalg.norm(cut) / np.linalg.norm(oracle) >= 0.999


def test_smollm2_as_an_embedder_against_transformers(smollm2_gguf: str, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    hf = hf_smollm2
    with LLM(smollm2_gguf, convert="embed", dtype="float32") as llm:
        assert llm.model_info.pooling_tasks == ["embed", "score"] and llm.model_info.enable_prefix_caching
        results = llm.embed(TEXTS)
        again = llm.embed(TEXTS[:1])  # from the prefix cache: LAST pooling keeps it
    for result in [*results, *again]:
        with torch.inference_mode():
            out = hf(torch.tensor([result.prompt_token_ids]), output_hidden_states=True)
        expected = torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1).numpy()
        assert float(np.dot(result.outputs.embedding, expected)) >= 0.99999


def test_classify_and_cross_encoder_scores_against_transformers(classifiers) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = classifiers["classifier"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = BertForSequenceClassification.from_pretrained(folder).eval()
    with LLM(str(folder)) as llm:
        assert llm.model_info.pooling_tasks == ["classify"]
        probs = [r.outputs.probs for r in llm.classify(TEXTS)]
    with torch.inference_mode():
        for text, got in zip(TEXTS, probs, strict=True):
            expected = torch.softmax(hf(**tokenizer(text, return_tensors="pt")).logits[0], -1)
            np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)

    folder = classifiers["cross-encoder"]
    hf = BertForSequenceClassification.from_pretrained(folder).eval()
    with LLM(str(folder)) as llm:
        assert llm.model_info.pooling_tasks == ["classify", "score"]
        scores = [r.outputs.score for r in llm.score(TEXTS[0], TEXTS[1:])]
    with torch.inference_mode():
        for document, got in zip(TEXTS[1:], scores, strict=True):
            pair = tokenizer(TEXTS[0], document, return_tensors="pt")  # token types 0, then 1
            assert pair["token_type_ids"].max() == 1
            np.testing.assert_allclose(got, torch.sigmoid(hf(**pair).logits[0, 0]).item(), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_causal_sequence_classifier_against_transformers(family: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """LlamaForSequenceClassification (and Qwen3's): the score head over the last token's hidden state."""
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen3Config,
        Qwen3ForSequenceClassification,
    )

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(7)
    if family == "llama":
        hf = LlamaForSequenceClassification(LlamaConfig(**common)).eval()
    else:
        hf = Qwen3ForSequenceClassification(Qwen3Config(**common, head_dim=32)).eval()
    hf.save_pretrained(tmp_path)
    prompts = [[5, 9, 33, 2], list(range(1, 90)), [7]]
    with LLM(str(tmp_path), dtype="float32") as llm:
        assert llm.model_info.pooling_tasks == ["classify"] and llm.model_info.pooler.pooling_type == "LAST"
        got = [r.outputs.probs for r in llm.classify(prompts)]
    with torch.inference_mode():
        for ids, probs in zip(prompts, got, strict=True):
            expected = torch.softmax(hf(torch.tensor([ids])).logits[0], -1)
            np.testing.assert_allclose(probs, expected.numpy(), atol=1e-5)
