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


# shaped like HuggingFaceTB/SmolVLM-256M-Instruct's files: an Idefics3 config whose sub-configs name only a
# few fields (the vision one under the family's own model_type), and its image processor's tiling
SMOLVLM_256M = {
    "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190, "model_type": "idefics3",
    "scale_factor": 4, "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 576, "intermediate_size": 1536, "model_type": "llama", "num_attention_heads": 9,
                    "num_hidden_layers": 30, "num_key_value_heads": 3, "rope_theta": 100000, "vocab_size": 49280,
                    "max_position_embeddings": 8192, "tie_word_embeddings": False},
    "vision_config": {"hidden_size": 768, "image_size": 512, "model_type": "idefics3", "num_attention_heads": 12,
                      "patch_size": 16},
}  # fmt: skip
SMOLVLM_PROCESSOR = {"do_image_splitting": True, "max_image_size": {"longest_edge": 512},
                     "size": {"longest_edge": 2048}, "image_processor_type": "Idefics3ImageProcessor"}  # fmt: skip


def test_an_idefics3_config_reads_as_transformers_reads_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import Idefics3Config

    (tmp_path / "config.json").write_text(json.dumps(SMOLVLM_256M))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SMOLVLM_PROCESSOR))
    config, theirs = load_model_config(str(tmp_path)), Idefics3Config(**SMOLVLM_256M)
    text = theirs.text_config
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.rms_norm_eps) == (
        text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, text.rms_norm_eps,
    )  # fmt: skip
    vision, tower = config.vision, theirs.vision_config
    assert vision is not None
    assert (vision.hidden_size, vision.intermediate_size, vision.num_layers, vision.layer_norm_eps) == (
        tower.hidden_size, tower.intermediate_size, tower.num_hidden_layers, tower.layer_norm_eps,
    )  # fmt: skip
    assert vision.hidden_act == "gelu_tanh" and vision.post_norm and not vision.class_token
    # 32 x 32 patches a tile, 4 x 4 folded into one: 64 embeddings a tile, at most 4 x 4 tiles and the whole
    assert (vision.scale_factor, vision.max_tiles, vision.num_image_tokens) == (4, 17, 17 * 64)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**SMOLVLM_PROCESSOR, "do_image_splitting": False})
    )
    assert load_model_config(str(tmp_path)).vision.num_image_tokens == 64  # type: ignore[union-attr]
    bare = {k: v for k, v in SMOLVLM_256M.items() if k != "text_config"}  # transformers' own text defaults
    (tmp_path / "config.json").write_text(json.dumps(bare))
    assert (
        load_model_config(str(tmp_path)).rms_norm_eps
        == Idefics3Config(**bare).text_config.rms_norm_eps
        == 1e-5
    )


@pytest.mark.parametrize(
    ("change", "processor", "message"),
    [
        ({"scale_factor": 3}, SMOLVLM_PROCESSOR, "scale_factor=3 does not divide"),
        ({}, None, "no image processor config"),
        (
            {},
            {**SMOLVLM_PROCESSOR, "max_image_size": {"longest_edge": 384}},
            "are not the tower's image_size",
        ),
        ({}, {**SMOLVLM_PROCESSOR, "size": {"height": 512, "width": 512}}, "must each name a longest_edge"),
        (
            {"vision_config": {"model_type": "clip_vision_model"}},
            SMOLVLM_PROCESSOR,
            "vision tower .clip_vision_model.",
        ),
    ],
)
def test_what_idefics3_does_not_run_is_refused_by_name(tmp_path, change, processor, message) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({**SMOLVLM_256M, **change}))
    if processor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(str(tmp_path))
