"""Hugging Face transformers as the correctness oracle: greedy generate, with the logits of each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OracleRun:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated position: [vocab] log-softmax of HF's logits


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> OracleRun:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return OracleRun(tokens, logprobs)


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
