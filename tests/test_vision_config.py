"""The worker reads a vision-language checkpoint's config.json without transformers: the defaults it fills
for the fields a released checkpoint leaves out are transformers' own, and what we do not implement is
refused by name."""

from __future__ import annotations

import json

import pytest

from worker.config_files import load_model_config
from worker.model_config import UnsupportedModelError
from worker.models.vision_config import SUB_CONFIG_DEFAULTS


@pytest.mark.parametrize("model_type", sorted(SUB_CONFIG_DEFAULTS))
def test_the_defaults_are_transformers(model_type: str) -> None:
    from transformers import AutoConfig

    theirs = AutoConfig.for_model(model_type).to_dict()
    for key, value in SUB_CONFIG_DEFAULTS[model_type].items():
        assert theirs.get(key) == value, (model_type, key, theirs.get(key), value)


LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf's config.json, as released (its sub-configs name only a few fields)
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "vision_config": {
        "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
        "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}  # fmt: skip


def test_a_released_llava_config_reads_as_transformers_reads_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15))
    config = load_model_config(str(tmp_path))
    assert (config.hidden_size, config.num_layers, config.num_heads, config.vocab_size) == (
        4096,
        32,
        32,
        32064,
    )
    vision = config.vision
    assert vision is not None
    assert (vision.hidden_size, vision.num_layers, vision.image_size, vision.num_image_tokens) == (
        1024,
        23,
        336,
        576,
    )
    assert vision.hidden_act == "quick_gelu" and vision.image_token_id == 32000 and vision.drop_first


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vision_feature_layer": [-2, -5]}, "features of several layers"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
        ({"text_config": {"model_type": "gemma"}}, "sub-model is not supported"),
        ({"vision_config": {"model_type": "pixtral"}}, "sub-model is not supported"),
        ({"projector_hidden_act": "mish"}, "activation 'mish'"),
    ],
)
def test_what_we_do_not_run_is_refused_by_name(tmp_path, change, message) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({**LLAVA_15, **change}))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(str(tmp_path))
