"""Structured outputs in the offline API (`SamplingParams(structured_outputs=...)`) on SmolLM2: a JSON
schema and a choice obeyed, a bad regex refused, and a constraint that waits for its start marker.
(A model without a tokenizer: tests/test_llm_api.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.offline.llm import LLM
from protocol import SamplingParams, StructuredOutputsParams
from protocol.errors import InvalidParameterError

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
