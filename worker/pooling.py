"""Which runner a model runs and, for a pooling model, how it pools: vLLM's --runner, --convert and
--pooler-config, with a sentence-transformers folder's own files as the model's defaults.

- runner "auto": pooling for an encoder (BertModel), a sequence classifier (*ForSequenceClassification:
  BERT's, Llama's, Qwen's) or when --convert asks for a conversion; else generate.
- convert "auto": classify for a *ForSequenceClassification, embed for everything else. "embed" on a
  causal LM pools its last token, normalized (vLLM's as_embedding_model); on an encoder, CLS unless the
  folder's 1_Pooling/config.json says otherwise.
- A sentence-transformers folder: modules.json's Pooling module (1_Pooling/config.json: CLS, MEAN or
  LAST), its Normalize module, and sentence_bert_config.json's max_seq_length (the longest input).
- --pooler-config's fields, where set, win over all of these.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from protocol.config import WorkerConfig
from protocol.pooling import POOLING_TYPES, PoolerConfig
from worker.model_config import ModelConfig, UnsupportedModelError

RUNNERS = ("auto", "generate", "pooling")
CONVERSIONS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class PoolingSetup:
    tasks: list[str]  # protocol.pooling.POOLING_TASKS the model serves
    pooler: PoolerConfig  # every field resolved
    max_seq_length: int | None  # a sentence-transformers folder's longest input, if it says


def resolve_pooling(config: WorkerConfig, model_config: ModelConfig) -> PoolingSetup | None:
    """None: the model generates. Raises UnsupportedModelError for a combination that cannot run."""
    runner, convert = config.runner, config.convert
    if runner not in RUNNERS:
        raise UnsupportedModelError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERSIONS:
        raise UnsupportedModelError(f"--convert must be one of {', '.join(CONVERSIONS)}, got {convert!r}")
    classifier = model_config.num_labels > 0
    if model_config.is_encoder_decoder and runner == "pooling":
        raise UnsupportedModelError(f"{model_config.architecture} transcribes audio: it does not pool")
    if runner == "auto":
        pools = model_config.is_encoder or classifier or convert not in ("auto", "none")
        runner = "pooling" if pools else "generate"
    if runner == "generate":
        if model_config.is_encoder or classifier:
            raise UnsupportedModelError(
                f"{model_config.architecture} is an encoder or a classifier: it embeds or classifies "
                "(--runner pooling), it does not generate"
            )
        if convert not in ("auto", "none"):
            raise UnsupportedModelError(f"--convert {convert} needs --runner pooling (or auto)")
        return None
    if convert in ("auto", "none"):
        convert = "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise UnsupportedModelError(
            f"--convert classify needs a *ForSequenceClassification checkpoint (a score head); "
            f"{model_config.architecture} has none"
        )
    if convert == "embed" and classifier:
        raise UnsupportedModelError(
            f"{model_config.architecture} classifies: serve it with --convert classify"
        )
    folder = config.model if os.path.isdir(config.model) else None
    st = _sentence_transformers(folder) if folder else {}
    if convert == "embed":
        default = PoolerConfig(
            pooling_type=st.get("pooling_type") or ("CLS" if model_config.is_encoder else "LAST"),
            normalize=st.get("normalize", True),
            activation=False,
        )
        tasks = ["embed", "score"]  # score: the cosine of two embeddings
    else:  # an encoder's classifier reads [CLS], a causal LM's its last token
        default = PoolerConfig(
            pooling_type="CLS" if model_config.is_encoder else "LAST", normalize=False, activation=True
        )
        # one label: a cross-encoder's relevance score (vLLM serves /score and /rerank with it)
        tasks = ["classify", "score"] if model_config.num_labels == 1 else ["classify"]
    pooler = _merge(default, config.pooler_config)
    if pooler.pooling_type not in POOLING_TYPES:
        raise UnsupportedModelError(
            f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooler.pooling_type!r}"
        )
    if pooler.pooling_type == "CLS" and not model_config.is_encoder:
        raise UnsupportedModelError(
            "CLS pooling on a causal LM pools its first token, which sees no other: use LAST or MEAN"
        )
    if pooler.pooling_type == "ALL":
        tasks = ["token_embed"]  # a vector per token: /pooling only (no embedding, no cosine)
    if convert == "classify" and pooler.pooling_type != default.pooling_type:
        raise UnsupportedModelError(
            f"this sequence classifier pools its {default.pooling_type} row: pooling_type must be {default.pooling_type}"
        )
    dims = pooler.matryoshka_dimensions or st.get("matryoshka_dimensions", [])
    if pooler.dimensions is not None and pooler.dimensions not in [*dims, model_config.hidden_size]:
        raise UnsupportedModelError(
            f"--pooler-config dimensions {pooler.dimensions}: the model's sizes are {dims or [model_config.hidden_size]}"
        )
    pooler = PoolerConfig(
        pooling_type=pooler.pooling_type,
        normalize=pooler.normalize,
        dimensions=pooler.dimensions,
        matryoshka_dimensions=list(dims),
        activation=pooler.activation,
    )
    return PoolingSetup(tasks, pooler, st.get("max_seq_length"))


def _merge(default: PoolerConfig, given: PoolerConfig | None) -> PoolerConfig:
    if given is None:
        return default
    fields: dict[str, Any] = {
        name: getattr(given, name) if getattr(given, name) not in (None, []) else getattr(default, name)
        for name in PoolerConfig.__struct_fields__
    }
    if isinstance(fields["pooling_type"], str):
        fields["pooling_type"] = fields["pooling_type"].upper()
    return PoolerConfig(**fields)


def _sentence_transformers(folder: str) -> dict[str, Any]:
    """What a sentence-transformers folder says of pooling: pooling_type, normalize, max_seq_length,
    matryoshka_dimensions (each only where it says)."""
    found: dict[str, Any] = {}
    modules = _read_json(os.path.join(folder, "modules.json"))
    if not isinstance(modules, list):
        return found
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    found["normalize"] = "Normalize" in kinds
    if "Pooling" in kinds:
        pooling = _read_json(os.path.join(folder, str(kinds["Pooling"].get("path", "")), "config.json")) or {}
        modes = [mode for mode, key in _POOLING_MODES.items() if pooling.get(key)]
        others = [
            k
            for k, v in pooling.items()
            if k.startswith("pooling_mode_") and v and k not in _POOLING_MODES.values()
        ]
        if len(modes) != 1 or others:
            raise UnsupportedModelError(
                f"the sentence-transformers pooling of {folder!r} is not one of CLS, MEAN, LAST: {pooling}"
            )
        found["pooling_type"] = modes[0]
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise UnsupportedModelError(
            f"{folder!r} has sentence-transformers modules we do not run: {sorted(unknown)}"
        )
    bert_config = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    if isinstance(bert_config.get("max_seq_length"), int):
        found["max_seq_length"] = bert_config["max_seq_length"]
    st_config = _read_json(os.path.join(folder, "config_sentence_transformers.json")) or {}
    dims = st_config.get("matryoshka_dims") or st_config.get("matryoshka_dimensions")
    if isinstance(dims, list):
        found["matryoshka_dimensions"] = [int(d) for d in dims]
    return found


_POOLING_MODES = {
    "CLS": "pooling_mode_cls_token",
    "MEAN": "pooling_mode_mean_tokens",
    "LAST": "pooling_mode_lasttoken",
}


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
