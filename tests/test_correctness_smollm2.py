"""SmolLM2-135M-Instruct loaded from its GGUF file, through the offline API (real engine and worker
processes): greedy output equals HF transformers' generate token for token in float32, with prefix
caching on and off, 16-token chunks and forced preemption; logprobs match; seeds reproduce."""

from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from protocol.config import DEFAULT_BLOCK_SIZE
from tests.hf_oracle import compare_greedy, hf_greedy_batch

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "Translate 'good morning' into Spanish.",
    "You are planning a picnic for six friends on a Saturday afternoon in a city park. Suggest a menu with "
    "sandwiches, drinks and a dessert, keeping in mind that one friend is vegetarian and another cannot eat "
    "nuts. Keep the answer short.",
    "What is 17 + 25?",
]


@pytest.fixture(scope="module")
def oracle(smollm2_tokenizer, hf_smollm2):  # type: ignore[no-untyped-def]
    tokenizer = smollm2_tokenizer
    model = hf_smollm2  # transformers' own dequantization, kept across runs
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    runs = hf_greedy_batch(model, prompts, MAX_NEW_TOKENS, eos_token_id=2)
    return prompts, runs, model


@pytest.fixture(scope="module")
def llm(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    with LLM(smollm2_gguf, dtype="float32", max_model_len=1024, num_kv_blocks=256) as llm:
        yield llm


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=2)


def check_all(results, prompts, runs) -> None:  # type: ignore[no-untyped-def]
    assert len(results) == len(prompts)
    for result, ids, run in zip(results, prompts, runs, strict=True):
        assert result.prompt_token_ids == ids
        compare_greedy(result.outputs[0].token_ids, run)


def test_chat_prompts_batched_match_hf(llm, oracle) -> None:  # type: ignore[no-untyped-def]
    prompts, runs, _ = oracle
    results = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], GREEDY)
    check_all(results, prompts, runs)
    # Logprobs of the chosen tokens within 1e-3 of HF's log-softmax, up to any near-tie.
    for result, run in zip(results, runs, strict=True):
        output = result.outputs[0]
        comparison = compare_greedy(output.token_ids, run)
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        for position in range(comparison.num_matching):
            token = output.token_ids[position]
            ours = output.logprobs[position][token].logprob
            assert abs(ours - float(run.logprobs[position][token])) < 1e-3, (position, ours)
        assert output.finish_reason in ("stop", "length")
        assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),
        dict(num_kv_blocks=12, block_size=16, max_model_len=192, max_num_batched_tokens=256),
        dict(async_scheduling=False),
    ],
    ids=["no_prefix_caching", "chunk_16", "tiny_pool_preemption", "no_async_scheduling"],
)
def test_engine_configurations_match_hf(smollm2_gguf, oracle, engine_kwargs) -> None:  # type: ignore[no-untyped-def]
    prompts, runs, _ = oracle
    engine_kwargs = {"max_model_len": 1024, "num_kv_blocks": 256, **engine_kwargs}
    with LLM(smollm2_gguf, dtype="float32", **engine_kwargs) as llm:
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
        stats = llm.get_stats()
        assert llm.check_invariants()
    check_all(results, prompts, runs)
    if engine_kwargs.get("num_kv_blocks") == 12:
        assert stats["num_preemptions"] > 0, stats
    if not engine_kwargs.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] == 0


def test_shared_prefix_reports_cached_tokens_and_matches_hf(llm, oracle) -> None:  # type: ignore[no-untyped-def]
    _, _, model = oracle
    system = (
        "You are a meticulous assistant for a small bakery. You answer questions about opening hours, "
        "ingredients and allergens, always politely and in at most two sentences. The bakery opens at "
        "7am and closes at 6pm, every day except Monday. It sells sourdough and rye bread, croissants, "
        "cinnamon rolls and seasonal fruit tarts; the tarts and the rolls contain milk and eggs, the "
        "croissants contain butter, and nothing on the counter contains peanuts. Orders for cakes are "
        "taken two days in advance by phone."
    )  # over two 64-token blocks with the chat template, so the second chat finds a cached prefix
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for question in ("When do you open on Sunday?", "Do your croissants contain nuts?")
    ]
    first = llm.chat(conversations[0], GREEDY)[0]
    second = llm.chat(conversations[1], GREEDY)[0]
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens % DEFAULT_BLOCK_SIZE == 0
    runs = hf_greedy_batch(model, [first.prompt_token_ids, second.prompt_token_ids], MAX_NEW_TOKENS, 2)
    for result, run in zip((first, second), runs, strict=True):
        compare_greedy(result.outputs[0].token_ids, run)


def test_seeded_sampling_is_reproducible(llm) -> None:  # type: ignore[no-untyped-def]
    prompt = "Once upon a time,"

    def run(seed: int) -> str:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].text

    first = run(1234)
    # Same seed, same text, even when other requests share the batch.
    crowded = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True)
            for s in (1234, 5, 6)
        ],
    )
    assert crowded[0].outputs[0].text == first
    assert run(1234) == first
    assert len({run(1), run(2), run(3)}) > 1


def test_n_completions_and_stop_strings(llm) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=40, stop=["."])
    result = llm.generate("The three best things about summer are", params)[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    for output in result.outputs:
        assert "." not in output.text
        assert output.finish_reason in ("stop", "length")
        if output.stop_reason == ".":
            assert output.finish_reason == "stop"
    stats = llm.get_stats()
    assert stats["num_running"] == 0
    assert llm.check_invariants()


def test_prompt_logprobs_match_hf(llm, oracle) -> None:  # type: ignore[no-untyped-def]
    prompts, _, model = oracle
    ids = prompts[0]
    result = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position in range(1, len(ids)):
        entry = result.prompt_logprobs[position]
        assert entry is not None
        token = ids[position]
        assert abs(entry[token].logprob - float(expected[position - 1, token])) < 1e-3
