"""Structured outputs in the offline API (`SamplingParams(structured_outputs=...)`) on SmolLM2, and on a
model without a tokenizer, where the worker cannot build a grammar: that request fails with a typed
error and the engine goes on, with no block left behind."""

from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.offline.llm import LLM
from protocol import SamplingParams, StructuredOutputsParams
from protocol.errors import InvalidParameterError
from tests.test_correctness_tiny import build_tiny

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    with LLM(smollm2_gguf, dtype="float32", max_model_len=512, num_kv_blocks=48) as llm:
        yield llm


def test_offline_structured_outputs(llm: LLM) -> None:
    question = [{"role": "user", "content": "Name a big city and its rank."}]
    result = llm.chat(
        question,
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    )
    jsonschema.validate(json.loads(result[0].outputs[0].text), SCHEMA)
    choice = StructuredOutputsParams(choice=["north", "south"])
    assert llm.chat(question, SamplingParams(temperature=0, max_tokens=5, structured_outputs=choice))[
        0
    ].outputs[0].text in ("north", "south")
    with pytest.raises(InvalidParameterError) as caught:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(")))
    assert caught.value.param == "structured_outputs"


def test_the_constraint_waits_for_its_start_marker(llm: LLM) -> None:
    prompt = "The three primary colors are"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    marker = free.token_ids  # what the model writes first anyway: the constraint begins after it
    spec = StructuredOutputsParams(regex="[0-9]{4}", start_after_token_ids=marker)
    constrained = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, structured_outputs=spec)
    )[0].outputs[0]
    assert constrained.token_ids[: len(marker)] == marker
    assert constrained.text.startswith(free.text) and constrained.text[len(free.text) :].isdigit()
    assert len(constrained.text) - len(free.text) == 4


def test_without_a_tokenizer_the_request_fails_and_the_engine_goes_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = str(tmp_path / "tiny")
    build_tiny("llama", folder)
    with LLM(folder, dtype="float32", max_model_len=64, num_kv_blocks=16) as llm:
        spec = StructuredOutputsParams(regex="a+")
        with pytest.raises(InvalidParameterError) as caught:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=spec))
        assert caught.value.param == "structured_outputs" and "tokenizer" in caught.value.message
        ok = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(ok[0].outputs[0].token_ids) == 3
        stats = llm.get_stats()
        assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0 and llm.check_invariants()
