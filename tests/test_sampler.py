"""The sampler as a pure function: greedy, filters, penalties, bias, min_tokens bans, seeds, logprobs."""

from __future__ import annotations

import torch

from worker.sampler import SamplingBatch, sample


def batch(rows: int, **overrides) -> SamplingBatch:  # type: ignore[no-untyped-def]
    fields = dict(
        temperature=torch.zeros(rows),
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=[None] * rows,
        num_output_tokens=[0] * rows,
        generator=torch.Generator().manual_seed(0),
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.5, 0.0, 0.0]])
    out = sample(logits, batch(2, max_num_logprobs=2))
    assert out.token_ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.ranks is not None
    assert out.logprob_token_ids.tolist() == [[1, 1, 3], [0, 0, 1]]
    assert torch.allclose(out.logprobs[0], expected[0, [1, 1, 3]])
    assert out.ranks.tolist() == [1, 1]


def test_top_k_one_equals_greedy_even_when_hot() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, batch(4, temperature=torch.full((4,), 5.0), top_k=torch.ones(4, dtype=torch.long)))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    for seed in range(50):
        b = batch(1, temperature=torch.ones(1), top_p=torch.tensor([0.8]), seeds=[seed])
        assert sample(logits, b).token_ids.item() in (0, 1)


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05]]))
    for seed in range(50):
        b = batch(1, temperature=torch.ones(1), min_p=torch.tensor([0.2]), seeds=[seed])
        assert sample(logits, b).token_ids.item() != 2


def test_seeded_rows_reproduce_and_differ_by_seed() -> None:
    logits = torch.zeros(1, 1000)

    def draw(seed: int, position: int) -> int:
        b = batch(1, temperature=torch.ones(1), seeds=[seed], num_output_tokens=[position])
        return int(sample(logits, b).token_ids.item())

    assert draw(3, 0) == draw(3, 0)
    assert draw(3, 5) == draw(3, 5)
    assert len({draw(s, 0) for s in range(10)}) > 5
    assert len({draw(3, p) for p in range(10)}) > 5


def test_penalties_and_bias_and_bans() -> None:
    vocab = 5
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.0]])
    pad = vocab
    common = dict(
        output_token_ids=torch.tensor([[0, 0, pad]]),
        prompt_token_ids=torch.tensor([[pad]]),
        presence_penalty=torch.tensor([0.0]),
        repetition_penalty=torch.tensor([1.0]),
    )
    # frequency penalty: token 0 seen twice -> 2.0 - 2 * 0.5 = 1.0 < 1.9
    out = sample(logits, batch(1, frequency_penalty=torch.tensor([0.5]), **common))
    assert out.token_ids.item() == 1
    # repetition penalty on a positive logit divides it: 2.0 / 2 = 1.0 < 1.9
    common["repetition_penalty"] = torch.tensor([2.0])
    out = sample(logits, batch(1, frequency_penalty=torch.tensor([0.0]), **common))
    assert out.token_ids.item() == 1
    # logit bias
    b = batch(1, bias_rows=torch.tensor([0]), bias_tokens=torch.tensor([4]), bias_values=torch.tensor([10.0]))
    assert sample(logits, b).token_ids.item() == 4
    # min_tokens ban
    b = batch(1, banned_rows=torch.tensor([0]), banned_tokens=torch.tensor([0]))
    assert sample(logits, b).token_ids.item() == 1


def test_temperature_zero_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    b = batch(3, temperature=torch.tensor([0.0, 1.0, 0.0]))
    out = sample(logits, b).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_argmax_only_is_the_samplers_plain_greedy_at_every_step() -> None:
    """SamplingParams.argmax_only (the model runner's argmax without a SamplingBatch) holds exactly where the
    batch sampling_batch builds is plain greedy at every step (here the first output token and the third)
    and no grammar masks it: each setting that changes the logits or asks for their values turns it off."""
    from protocol.sampling import SamplingParams, TimestampRules
    from protocol.structured_outputs import StructuredOutputsParams
    from protocol.worker_messages import NewRequestData
    from worker.input_batch import InputBatch
    from worker.sampling_batch import sampling_batch

    greedy = {"temperature": 0.0}
    variants = [
        {},
        {"temperature": 0.7},
        {"logprobs": 0},
        {"logprob_token_ids": [3]},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: 1.0}},
        {"min_tokens": 1},
        {"min_tokens": 5, "max_tokens": 8},
        {"bad_words_token_ids": [[5]]},
        {"begin_suppress_token_ids": [2]},
        {"allowed_token_ids": [1, 2]},
        {"timestamp_rules": TimestampRules(timestamp_begin=20, no_timestamps=19, eos=18)},
        {"structured_outputs": StructuredOutputsParams(regex="a+")},
        {"seed": 7, "stop_token_ids": [9], "top_k": 5, "prompt_logprobs": 2},  # greedy all the same
    ]
    for variant in variants:
        params = SamplingParams(**{**greedy, **variant})
        plain = []  # the batch's plain_greedy at each step
        for outputs in ([], [4, 6]):
            batch_state = InputBatch(max_num_seqs=2, max_model_len=64, block_size=16)
            batch_state.add(NewRequestData("r", [1, 2, 3], outputs, params, [0], 3 + len(outputs)))
            state = batch_state.requests["r"]
            sampling = sampling_batch(batch_state, [state], 32, [0], torch.Generator(), None)
            plain.append(sampling.plain_greedy)
        structured = params.structured_outputs is not None  # (its mask is the grammar's, apart)
        assert state.argmax_only == (all(plain) and not structured), variant
        assert state.argmax_only == (variant in ({}, variants[-1])), variant
