"""The grammar backend and the worker's GrammarManager on SmolLM2's real tokenizer, without a model: what
validation refuses (never silently relaxed), the bitmask each step allows, the padded vocabulary, EOS
once a grammar is complete, compile timeouts, preemption replay, and the start-after marker."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from protocol.config import WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.structured_outputs import StructuredOutputsParams
from structured_outputs import backend_class, resolve_backend_name
from worker.grammar import GrammarManager

EOS = 2
PADDED_VOCAB = 49152 + 64  # a model whose logits are wider than its tokenizer's vocabulary


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):  # type: ignore[no-untyped-def]
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def manager(smollm2_gguf: str, tokenizer):  # type: ignore[no-untyped-def]
    """One for the module: the backend's trie is built once; each test uses its own request ids."""
    cache = os.path.join(os.path.expanduser("~"), ".cache", "engine")
    config = WorkerConfig(model=smollm2_gguf, cache_dir=cache, grammar_compile_timeout_s=20)
    grammar = GrammarManager(config, PADDED_VOCAB, [EOS])
    yield grammar
    grammar.shutdown()


def allowed(manager: GrammarManager, request_ids: list[str]) -> list[set[int]]:
    mask, errors = manager.apply(manager.start_bitmask(request_ids))
    assert not errors, errors
    assert mask is not None and mask.shape == (len(request_ids), PADDED_VOCAB)
    return [set(np.nonzero(row.numpy())[0].tolist()) for row in mask]


def feed(manager: GrammarManager, request_id: str, ids: list[int]) -> None:
    for token_id in ids:
        assert token_id in allowed(manager, [request_id])[0], token_id
        manager.accept(request_id, token_id)


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutputsParams(json={"type": "object", "not": {}}), "not"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(json={"type": "string", "format": "made-up"}), "made-up"),
        (StructuredOutputsParams(json={"type": "strin"}), "strin"),
        (StructuredOutputsParams(regex="(?=a)b"), "look"),
        (StructuredOutputsParams(regex="a("), "unclosed"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
        (StructuredOutputsParams(grammar='root ::= "a" missing'), "missing"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(structural_tag=json.dumps({"structures": []})), "structures"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutputsParams(), "exactly one"),
    ],
)
def test_validation_refuses_what_the_backend_cannot_enforce(
    spec: StructuredOutputsParams, words: str
) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        backend_class("auto").validate(spec)
    assert caught.value.param == "structured_outputs" and words in caught.value.message


def test_backend_names_are_vllm_s() -> None:
    assert resolve_backend_name("auto") == resolve_backend_name("guidance") == "guidance"
    with pytest.raises(ValueError, match="not built in"):
        resolve_backend_name("xgrammar")
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend_name("nope")


def test_json_bitmask_follows_the_schema_to_eos(manager: GrammarManager, tokenizer) -> None:  # type: ignore[no-untyped-def]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    manager.add("a", StructuredOutputsParams(json=schema, disable_any_whitespace=True), [])
    manager.add("free", StructuredOutputsParams(regex="x+"), [])
    first, free = allowed(manager, ["a", "free"])
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in first)
    assert not any(t >= 49152 for t in first | free), "padded vocabulary rows are masked"
    feed(manager, "a", tokenizer.encode('{"ok":true}', add_special_tokens=False))
    assert allowed(manager, ["a"])[0] == {EOS}, "a complete grammar allows only EOS"
    # a request without a grammar in the same step: its row allows everything
    mask, _ = manager.apply(manager.start_bitmask(["a", "unconstrained"]))
    assert mask is not None and bool(mask[1].all())


def test_equal_specs_share_one_compile_and_preemption_replays(manager: GrammarManager, tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    manager.add("s1", spec, [])
    manager.add("s2", spec, [])
    assert manager.requests["s1"].compiled is manager.requests["s2"].compiled
    ids = tokenizer.encode("alpha", add_special_tokens=False)
    feed(manager, "s1", ids)
    manager.remove("s1")  # preempted: it comes back with its output so far
    manager.add("s1", spec, ids)
    rest = allowed(manager, ["s1", "s2"])
    assert all(tokenizer.decode([t]).startswith(" ") or t == EOS for t in rest[0])
    assert rest[0] != rest[1]


def test_the_constraint_starts_after_the_marker(manager: GrammarManager, tokenizer) -> None:  # type: ignore[no-untyped-def]
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    manager.add("r", StructuredOutputsParams(choice=["yes", "no"], start_after_token_ids=marker), [])
    assert manager.start_bitmask(["r"]) is None, "free while thinking"
    for token_id in tokenizer.encode("hmm, so", add_special_tokens=False) + marker:
        manager.accept("r", token_id)
    options = allowed(manager, ["r"])[0]
    assert options and all(
        "yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])) for t in options
    )


def test_a_grammar_not_ready_in_time_fails_its_request(smollm2_gguf: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    cache = os.path.join(os.path.expanduser("~"), ".cache", "engine")
    config = WorkerConfig(model=smollm2_gguf, cache_dir=cache, grammar_compile_timeout_s=0.05)
    manager = GrammarManager(config, PADDED_VOCAB, [EOS])
    try:
        manager.pool.submit(time.sleep, 1.0)  # both compile threads busy past the deadline
        manager.pool.submit(time.sleep, 1.0)
        manager.add("slow", StructuredOutputsParams(regex="a+"), [])
        mask, errors = manager.apply(manager.start_bitmask(["slow"]))
        assert (
            "did not compile within" in errors["slow"].message
            and errors["slow"].param == "structured_outputs"
        )
    finally:
        manager.shutdown()


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "qwen3_xml", "pythonic"])
def test_auto_structural_tags_accept_a_valid_call_and_refuse_a_bad_one(
    manager: GrammarManager, tokenizer, parser_name: str
) -> None:  # type: ignore[no-untyped-def]
    from frontend.parsers.registry import Parsers

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                    "required": ["city", "days"],
                },
            },
        }
    ]
    good, bad = {
        "hermes": (
            'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": "two"',
        ),
        "llama3_json": (
            '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
            '{"name": "get_time", ',
        ),
        "mistral": (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"days": 0',
        ),
        "pythonic": ('[get_weather(city="Rome", days=2)]', '[get_weather(days="two"'),
        "qwen3_xml": (
            "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\nthree",
        ),
    }[parser_name]
    parser = Parsers().tool_parser(parser_name)(tools)
    tag, grammar = parser.structural_tag(), parser.auto_grammar()
    spec = (
        StructuredOutputsParams(structural_tag=json.dumps(tag))
        if tag
        else StructuredOutputsParams(grammar=grammar)
    )
    backend_class("auto").validate(spec)
    backend = manager.backend()
    matcher = backend.compile(spec)
    assert all(matcher.accept_token(t) for t in tokenizer.encode(good, add_special_tokens=False)), (
        matcher.error
    )
    matcher = backend.compile(spec)
    assert not all(matcher.accept_token(t) for t in tokenizer.encode(bad, add_special_tokens=False))
    assert [c.name for c in parser.parse(good, final=True).calls] == ["get_weather"]
    matcher = backend.compile(spec)  # ordinary text stays allowed
    assert all(matcher.accept_token(t) for t in tokenizer.encode("It is sunny.", add_special_tokens=False))
