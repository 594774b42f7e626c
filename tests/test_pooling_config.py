"""--runner, --convert and --pooler-config against the model folder (worker/pooling.py): what each
combination serves, and a clear error for each that cannot run."""

from __future__ import annotations

import json
import pathlib

import pytest

from protocol.config import WorkerConfig
from protocol.pooling import PoolerConfig
from tests.test_bert import TINY
from worker.config_files import load_model_config
from worker.model_config import UnsupportedModelError
from worker.pooling import resolve_pooling


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("pooling-config")
    bert = {"architectures": ["BertModel"], "model_type": "bert", **TINY}
    classifier = {
        **bert,
        "architectures": ["BertForSequenceClassification"],
        "id2label": {"0": "no", "1": "yes"},
    }
    llama = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2,
    }  # fmt: skip
    made = {}
    for name, config in (("bert", bert), ("st", bert), ("classifier", classifier), ("llama", llama)):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        made[name] = folder
    st = made["st"]  # a sentence-transformers folder: MEAN pooling, normalized, 32 tokens at most
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (st / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    return made


def resolve(folder: pathlib.Path, **kwargs):  # type: ignore[no-untyped-def]
    config = WorkerConfig(model=str(folder), **kwargs)
    return resolve_pooling(config, load_model_config(str(folder)))


def test_a_sentence_transformers_folder_is_an_embedder_as_it_says(folders) -> None:  # type: ignore[no-untyped-def]
    setup = resolve(folders["st"])
    assert setup.tasks == ["embed", "score"] and setup.max_seq_length == 32
    assert (setup.pooler.pooling_type, setup.pooler.normalize) == ("MEAN", True)
    # the flag wins over the folder
    setup = resolve(folders["st"], pooler_config=PoolerConfig(pooling_type="cls", normalize=False))
    assert (setup.pooler.pooling_type, setup.pooler.normalize) == ("CLS", False)


def test_all_pooling_serves_token_embeddings_only(folders) -> None:  # type: ignore[no-untyped-def]
    setup = resolve(folders["st"], pooler_config=PoolerConfig(pooling_type="ALL"))
    assert setup.tasks == ["token_embed"]  # no /v1/embeddings vector, no cosine


def test_a_sentence_transformers_pooling_we_do_not_run_is_refused(folders, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    folder = tmp_path / "sqrt"
    shutil.copytree(folders["st"], folder)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_mean_sqrt_len_tokens": True})
    )
    with pytest.raises(UnsupportedModelError, match="not one of CLS, MEAN, LAST"):
        resolve(folder)


def test_defaults_by_architecture(folders) -> None:  # type: ignore[no-untyped-def]
    assert resolve(folders["bert"]).pooler.pooling_type == "CLS"
    classifier = resolve(folders["classifier"])
    assert classifier.tasks == ["classify"] and classifier.pooler.activation is True
    assert resolve(folders["llama"]) is None  # a causal LM generates unless asked
    embedder = resolve(folders["llama"], convert="embed")
    assert (embedder.pooler.pooling_type, embedder.pooler.normalize) == ("LAST", True)
    assert resolve(folders["llama"], runner="pooling").tasks == ["embed", "score"]


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("bert", {"runner": "generate"}, "is an encoder"),
        ("llama", {"convert": "classify"}, "needs a \\*ForSequenceClassification"),
        ("classifier", {"convert": "embed"}, "classifies"),
        ("llama", {"runner": "generate", "convert": "embed"}, "needs --runner pooling"),
        ("st", {"pooler_config": PoolerConfig(pooling_type="MAX")}, "pooling_type must be one of"),
        ("st", {"pooler_config": PoolerConfig(dimensions=16)}, "dimensions 16"),
        ("classifier", {"pooler_config": PoolerConfig(pooling_type="MEAN")}, "must be CLS"),
        ("llama", {"convert": "embed", "pooler_config": PoolerConfig(pooling_type="CLS")}, "first token"),
    ],
)
def test_combinations_that_cannot_run_say_why(folders, name: str, kwargs, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedModelError, match=message):
        resolve(folders[name], **kwargs)
