"""End to end, each request field the frontend implements, through the official `openai` client on a
real `engine serve` (SmolLM2): prompt logprobs, cache_salt, allowed_token_ids, bad_words,
return_token_ids, truncate_prompt_tokens, continuous usage on completions, completions' default
max_tokens, request ids, typed engine rejections; and the operator side a vLLM user brings along
(VLLM_API_KEY, x-api-key, --allowed-origins as a JSON list, --metrics-prefix vllm)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import openai
import pytest

from tests.serve_helpers import serving

pytestmark = pytest.mark.slow

KEY = "vllm-style-key"
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_KV_BLOCKS = 24


@pytest.fixture(scope="module")
def server(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    flags = [
        "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--served-model-name", MODEL, "--allowed-origins", '["https://a.example", "https://b.example"]',
        "--metrics-prefix", "vllm",
    ]  # fmt: skip
    env = {"VLLM_API_KEY": KEY, "ENGINE_API_KEY": None}
    with serving(smollm2_gguf, *flags, env=env, engine_address=True) as served:
        yield {"base": served.base, "engine": served.engine_address}


@pytest.fixture(scope="module")
def base(server: dict[str, str]) -> str:
    return server["base"]


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def tokenize(base: str, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return list(httpx.post(f"{base}/tokenize", json=body, headers={"x-api-key": KEY}).json()["tokens"])


def test_vllm_api_key_env_and_x_api_key(base: str) -> None:
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_allowed_origins_take_vllm_json_list(base: str) -> None:
    preflight = {"Access-Control-Request-Method": "POST"}
    for origin, allowed in (
        ("https://a.example", True),
        ("https://b.example", True),
        ("https://c.example", False),
    ):
        response = httpx.options(f"{base}/v1/completions", headers={**preflight, "Origin": origin})
        assert (response.headers.get("access-control-allow-origin") == origin) is allowed


def test_concurrent_requests_with_one_x_request_id_both_complete(client: openai.OpenAI) -> None:
    def ask(_: int) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
            extra_headers={"X-Request-Id": "same-id"}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        completion = raw.parse()
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 24
        return raw.headers["x-request-id"], completion.id

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        (header_a, id_a), (header_b, id_b) = pool.map(ask, range(2))
    assert header_a == header_b == "same-id"  # echoed, never the engine's key
    assert id_a != id_b


def test_completions_default_to_16_tokens(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 16


def test_prompt_logprobs_on_both_doors(base: str, client: openai.OpenAI) -> None:
    ids = tokenize(base, "The capital of France is")
    response = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0
        assert entry[str(token_id)]["rank"] >= 1 and len(entry) <= 3
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert len(chat_entries) == chat.usage.prompt_tokens and chat_entries[0] is None
    assert all(len(entry) == 1 for entry in chat_entries[1:])


def test_text_offset_counts_characters_without_echo(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=1
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_cache_salt_separates_prefix_cache_entries(client: openai.OpenAI) -> None:
    prompt = "Tell me about the weather in Paris in spring. " * 16  # > 1 block of 64 tokens

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_allowed_token_ids_and_return_token_ids(base: str, client: openai.OpenAI) -> None:
    allowed = tokenize(base, " banana apple")
    response = client.completions.create(
        model=MODEL, prompt="My favourite fruit is", max_tokens=6, temperature=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0].model_extra
    assert len(choice["token_ids"]) == 6 and set(choice["token_ids"]) <= set(allowed)
    assert choice["prompt_token_ids"] == tokenize(base, "My favourite fruit is")
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    streamed = [
        t for c in chunks for choice in c.choices for t in (choice.model_extra.get("token_ids") or [])
    ]
    assert streamed == chat.choices[0].model_extra["token_ids"]


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    banned = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in banned.choices[0].message.content


def test_truncate_prompt_tokens_keeps_the_last_tokens(base: str, client: openai.OpenAI) -> None:
    ids = tokenize(base, "one two three four five six seven eight nine ten")
    response = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert response.usage.prompt_tokens == 4
    decoded = httpx.post(f"{base}/detokenize", json={"tokens": ids[-4:]}, headers={"x-api-key": KEY})
    assert response.choices[0].text.startswith(decoded.json()["prompt"])


def test_continuous_usage_stats_on_completions(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)


def test_an_engine_rejection_is_a_typed_error_naming_the_parameter(server: dict[str, str]) -> None:
    """A ZMQ client (a harness speaking token ids, as `engine bench engine` does) skips the API server's
    checks: the engine itself refuses, with a typed error in the output, and stays healthy."""
    from frontend.engine.async_llm import AsyncLLM, final_state
    from frontend.engine.client import AsyncEngineClient
    from frontend.launcher import engine_addresses
    from protocol.errors import InvalidParameterError
    from protocol.sampling import SamplingParams

    async def run() -> None:
        client = AsyncEngineClient(*engine_addresses(server["engine"]))
        try:
            info = await client.register(30)
            llm = AsyncLLM(client, None)
            with pytest.raises(InvalidParameterError) as error:
                await final_state(llm.generate("bad-0", [1, info.vocab_size + 5], SamplingParams()))
            assert error.value.param == "prompt" and "prompt token ids" in error.value.message
            state = await final_state(
                llm.generate("good-0", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
            )
            assert len(state.choices[0].token_ids) == 2
        finally:
            client.close()

    asyncio.run(run())


def test_unsupported_fields_are_400s_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"use_beam_search": True})
    assert error.value.body["param"] == "use_beam_search"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as error:  # auto, without --enable-auto-tool-choice
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools)
    assert (
        error.value.body["param"] == "tool_choice"
        and "--enable-auto-tool-choice" in error.value.body["message"]
    )


def test_vllm_dashboard_families_under_the_vllm_prefix(base: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2)
    text = httpx.get(f"{base}/metrics").text
    for family in (
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:iteration_tokens_total_bucket",
        "vllm:request_params_n_bucket",
        "vllm:request_params_max_tokens_sum",
        "vllm:cache_config_info",
        "vllm:num_requests_running",
    ):
        assert family in text, family
    assert f'num_gpu_blocks="{NUM_KV_BLOCKS}"' in text
    assert "engine:" not in text
