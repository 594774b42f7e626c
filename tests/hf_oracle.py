"""Hugging Face transformers as the correctness oracle: greedy generate, with the logits of each step;
and its model of a GGUF file, dequantized by transformers once and kept."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

ORACLE_CACHE = pathlib.Path(os.path.expanduser("~")) / ".cache" / "engine" / "hf-oracle"


def hf_folder_of_gguf(gguf_path: str) -> pathlib.Path:
    """The transformers folder hf_model_of_gguf keeps (made now if it is not there yet): a base model
    for peft to make adapters of."""
    folder = _oracle_folder(gguf_path)
    if not (folder / "config.json").exists():
        hf_model_of_gguf(gguf_path)
    return folder


def _oracle_folder(gguf_path: str) -> pathlib.Path:
    from transformers import __version__ as transformers_version

    stat = os.stat(gguf_path)
    identity = f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers_version}|{torch.__version__}"
    return ORACLE_CACHE / hashlib.sha256(identity.encode()).hexdigest()[:16]


def hf_model_of_gguf(gguf_path: str) -> Any:
    """transformers' own model of a GGUF file in float32: its dequantization, not ours, is the oracle's.
    Dequantizing takes ~18 s, so the model is kept as a transformers folder (save_pretrained) under
    ~/.cache/engine/hf-oracle, keyed by the file and the transformers and torch versions; later runs
    load that folder in about a second."""
    from transformers import AutoModelForCausalLM

    folder = _oracle_folder(gguf_path)
    if (folder / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    directory, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    # NOTE: save_pretrained refuses a model loaded from GGUF; its float32 weights and its config (less
    # the GGUF marker) make an ordinary folder
    from safetensors.torch import save_model

    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    partial.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config))
    save_model(model, str(partial / "model.safetensors"))
    try:
        os.replace(partial, folder)  # whole or not at all, whoever wins a race
    except OSError:
        pass  # another run kept it first
    return model


@dataclass
class OracleRun:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated position: [vocab] log-softmax of HF's logits


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> OracleRun:  # type: ignore[no-untyped-def]
    (run,) = hf_greedy_batch(model, [prompt_ids], max_new_tokens, eos_token_id)
    return run


def hf_greedy_batch(  # type: ignore[no-untyped-def]
    model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> list[OracleRun]:
    """hf_greedy of each prompt, in one left-padded generate: a step's Python overhead, not its products,
    is most of HF's time on a small model (SmolLM2's 8 chat prompts: 9.0 s one by one, 4.1 s here, Zen 4).
    Each row differs from its run alone by the padded products' rounding: on those 8 prompts the same
    tokens, and logprobs within 8.8e-5 over the whole vocabulary, inside the tests' 1e-3. A row ends at
    its first EOS, as a run alone does (one prompt: no padding, the run itself)."""
    pad = eos_token_id if eos_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id, pad_token_id=pad, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    runs = []
    for row in range(len(prompts)):
        tokens = out.sequences[row, width:].tolist()
        if eos_token_id is not None and eos_token_id in tokens:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
        logprobs = [torch.log_softmax(out.logits[step][row].float(), dim=-1) for step in range(len(tokens))]
        runs.append(OracleRun(tokens, logprobs))
    return runs


@dataclass
class Comparison:
    num_matching: int  # tokens equal before the first difference
    near_tie_at: int | None  # position of a tolerated near-tie, if the outputs differ there


def compare_greedy(ours: list[int], oracle: OracleRun, tie_tolerance: float = 1e-4) -> Comparison:
    """Our tokens must equal HF's; the only tolerated difference is a genuine near-tie, where HF's top
    two logprobs differ by less than tie_tolerance and ours is HF's second choice. After a near-tie the
    continuations legitimately diverge, so nothing after it is compared."""
    for position, (mine, theirs) in enumerate(zip(ours, oracle.token_ids, strict=False)):
        if mine == theirs:
            continue
        top = oracle.logprobs[position].topk(2)
        gap = float(top.values[0] - top.values[1])
        if gap < tie_tolerance and mine == int(top.indices[1]):
            print(f"near-tie at output position {position}: HF gap {gap:.2e}, ours={mine}, HF={theirs}")
            return Comparison(position, position)
        raise AssertionError(
            f"output differs from HF at position {position}: ours {mine}, HF {theirs} (top-2 gap {gap:.3e})\n"
            f"ours: {ours}\nHF:   {oracle.token_ids}"
        )
    assert len(ours) == len(oracle.token_ids), f"lengths differ: ours {len(ours)}, HF {len(oracle.token_ids)}"
    return Comparison(len(ours), None)


if __name__ == "__main__":  # `make install`: the real checkpoints' oracles, made once (~30 s each)
    import sys

    for gguf_path in sys.argv[1:]:
        hf_folder_of_gguf(gguf_path)
        print(f"HF transformers' float32 model of {gguf_path} kept in {_oracle_folder(gguf_path)}")
