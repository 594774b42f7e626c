"""The BERT encoder (worker/models/bert.py) against Hugging Face transformers, on tiny random models
built here: hidden states with and without token types, a sequence classifier's logits, each input's
result alone equal to its result among others, on the torch path and on the csrc kernels."""

from __future__ import annotations

import pathlib

import pytest
import torch

from worker.config_files import load_model_config
from worker.models import build_model
from worker.models.bert import BertModel
from worker.weights import iterate_weights

TINY = dict(
    vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    max_position_embeddings=64, type_vocab_size=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def bert_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    from transformers import BertConfig, BertForSequenceClassification
    from transformers import BertModel as HFBertModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("bert")
    folders = {"encoder": root / "encoder", "classifier": root / "classifier"}
    HFBertModel(BertConfig(**TINY)).eval().save_pretrained(folders["encoder"])
    config = BertConfig(**TINY, num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"})
    BertForSequenceClassification(config).eval().save_pretrained(folders["classifier"])
    return folders


def ours(folder: pathlib.Path, ops=None, batch_invariant: bool = False) -> BertModel:  # type: ignore[no-untyped-def]
    config = load_model_config(str(folder))
    model = build_model(config, torch.float32, ops)
    assert isinstance(model, BertModel)
    model.load_weights(iterate_weights(str(folder), config, progress=False))
    model.finalize(batch_invariant)
    return model.eval()


def run(
    model: BertModel, inputs: list[list[int]], types: list[list[int]] | None = None
) -> list[torch.Tensor]:
    flat = torch.tensor([t for ids in inputs for t in ids])
    positions = torch.cat([torch.arange(len(ids)) for ids in inputs])
    segments, start = [], 0
    for ids in inputs:
        segments.append((start, start + len(ids)))
        start += len(ids)
    token_types = torch.tensor([t for row in types for t in row]) if types else None
    with torch.inference_mode():
        hidden = model(flat, positions, segments, token_types)
    return [hidden[a:b] for a, b in segments]


INPUTS = [[1, 5, 9, 2], [1, 7, 7, 7, 30, 44, 2], [1, 2], [1, *range(10, 60), 2]]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "csrc"])
def test_hidden_states_equal_transformers(
    bert_folders, kernels: bool, request: pytest.FixtureRequest
) -> None:  # type: ignore[no-untyped-def]
    from transformers import BertModel as HFBertModel

    ops = request.getfixturevalue("ops") if kernels else None
    model = ours(bert_folders["encoder"], ops, batch_invariant=kernels)
    hf = HFBertModel.from_pretrained(bert_folders["encoder"]).eval()
    types = [[0] * 2 + [1] * (len(ids) - 2) for ids in INPUTS]
    for with_types in (None, types):
        got = run(model, INPUTS, with_types)
        for i, ids in enumerate(INPUTS):
            kwargs = {"token_type_ids": torch.tensor([with_types[i]])} if with_types else {}
            with torch.inference_mode():
                expected = hf(torch.tensor([ids]), **kwargs).last_hidden_state[0]
            torch.testing.assert_close(got[i], expected, atol=2e-5, rtol=1e-4)


def test_each_input_is_the_same_alone_as_among_others(bert_folders, ops) -> None:  # type: ignore[no-untyped-def]
    model = ours(bert_folders["encoder"], ops, batch_invariant=True)
    together = run(model, INPUTS * 3)
    for i, ids in enumerate(INPUTS):
        (alone,) = run(model, [ids])
        assert torch.equal(alone, together[i]) and torch.equal(alone, together[i + 2 * len(INPUTS)])


def test_classifier_logits_equal_transformers(bert_folders) -> None:  # type: ignore[no-untyped-def]
    from transformers import BertForSequenceClassification

    model = ours(bert_folders["classifier"])
    assert model.config.num_labels == 3 and model.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    hf = BertForSequenceClassification.from_pretrained(bert_folders["classifier"]).eval()
    hidden = run(model, INPUTS)
    with torch.inference_mode():
        logits = model.classify(torch.stack([h[0] for h in hidden]))
        for i, ids in enumerate(INPUTS):
            torch.testing.assert_close(logits[i], hf(torch.tensor([ids])).logits[0], atol=2e-5, rtol=1e-4)
