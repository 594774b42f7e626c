"""Tool-call and reasoning parsers on recorded outputs of each format, streamed in random chunkings: the
streamed deltas, concatenated, equal the non-streamed parse (content, reasoning, each call's name and
arguments), and a call's first delta carries its id and name."""

from __future__ import annotations

import json
import random

import pytest

from frontend.parsers.base import Parsed, StreamingParse
from frontend.parsers.forced import NamedToolParser, RequiredToolParser
from frontend.parsers.hermes import HermesToolParser
from frontend.parsers.json_formats import Llama3JsonToolParser, MistralToolParser
from frontend.parsers.json_scan import read_call_object, value_end
from frontend.parsers.pythonic import PythonicToolParser
from frontend.parsers.qwen3_xml import Qwen3XmlToolParser
from frontend.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from frontend.parsers.registry import Parsers, load_plugin

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]

# (output, content, [(name, arguments)])
HERMES_OUTPUTS = [
    (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
    ),
    (  # Qwen2.5's parallel calls
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "note": "a \\"quoted\\" }"}}\n</tool_call>',
        "\n",
        [("get_weather", '{"city": "Rome"}'), ("get_time", '{"tz": "CET", "note": "a \\"quoted\\" }"}')],
    ),
    ('<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>', "", [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),
    ("No tools needed: 3 < 4 and <tool is not a tag.", "No tools needed: 3 < 4 and <tool is not a tag.", []),
    ("ends on a partial marker <tool_ca", "ends on a partial marker <tool_ca", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    # cut by max_tokens inside the arguments: still the call it began as
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par')],
    ),
]


def chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    result = [[text], list(text)]
    for _ in range(6):
        pieces, i = [], 0
        while i < len(text):
            step = rng.randint(1, 9)
            pieces.append(text[i : i + step])
            i += step
        result.append(pieces)
    return result


def streamed(parse, pieces: list[str]) -> tuple[Parsed, list]:  # type: ignore[no-untyped-def]
    """Feed the pieces; return (concatenated result, every call delta)."""
    streaming = StreamingParse(parse)
    content, reasoning = "", ""
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    deltas = []
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        delta = streaming.update(text, final=i == len(pieces) - 1)
        content += delta.content
        reasoning += delta.reasoning
        for call in delta.calls:
            deltas.append(call)
            if call.index not in calls:
                assert call.id and call.name, "a call's first delta carries its id and name"
                calls[call.index] = [call.name, ""]
                ids[call.index] = call.id
            else:
                assert call.id is None and call.name is None
            calls[call.index][1] += call.arguments
    result = Parsed(content, reasoning)
    result.calls = [type("C", (), {"name": n, "arguments": a})() for n, a in calls.values()]  # type: ignore[misc]
    return result, deltas


@pytest.mark.parametrize("output, content, calls", HERMES_OUTPUTS)
def test_hermes_streamed_in_any_chunking_equals_the_whole(output: str, content: str, calls: list) -> None:
    parser = HermesToolParser(TOOLS)
    whole = parser.parse(output, final=True)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for complete in [c for c in whole.calls if c.arguments.endswith("}")]:
        json.loads(complete.arguments)
    for seed, pieces in enumerate(chunkings(output, len(output))):
        result, _ = streamed(parser.parse, pieces)
        assert result.content == content, (seed, pieces)
        assert [(c.name, c.arguments) for c in result.calls] == calls, (seed, pieces)


# (parser, output, content, [(name, arguments)]): recorded outputs of each model family's format
FORMAT_OUTPUTS = [
    (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (Llama3JsonToolParser, "The weather is nice {really}.", "The weather is nice {really}.", []),
    (Llama3JsonToolParser, "{not a call}", "{not a call}", []),
    (
        MistralToolParser,
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_time", "arguments": {"tz": "PET"}}]',
        "Checking.",
        [("get_weather", '{"city": "Lima"}'), ("get_time", '{"tz": "PET"}')],
    ),
    (MistralToolParser, "No calls, just [brackets].", "No calls, just [brackets].", []),
    (
        PythonicToolParser,
        '[get_weather(city="San Francisco", days=3), get_time(tz="PST")]',
        "",
        [("get_weather", '{"city": "San Francisco", "days": 3}'), ("get_time", '{"tz": "PST"}')],
    ),
    (PythonicToolParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicToolParser, "Sure, here it is.", "Sure, here it is.", []),
    (
        Qwen3XmlToolParser,
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>",
        "Let me check.\n",
        [("get_weather", '{"city": "New York", "days": 5}')],
    ),
    (
        Qwen3XmlToolParser,
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\na < b </x>\n</parameter>\n</function>\n</tool_call>",
        "\n",
        [("get_time", "{}"), ("get_weather", '{"city": "a < b </x>"}')],
    ),
]


@pytest.mark.parametrize("cls, output, content, calls", FORMAT_OUTPUTS)
def test_each_format_streamed_in_any_chunking_equals_the_whole(
    cls, output: str, content: str, calls: list
) -> None:  # type: ignore[no-untyped-def]
    parser = cls(TOOLS)
    whole = parser.parse(output, final=True)
    assert (whole.content, [(c.name, c.arguments) for c in whole.calls]) == (content, calls)
    for call in whole.calls:
        json.loads(call.arguments)
    for pieces in chunkings(output, len(output)):
        result, _ = streamed(parser.parse, pieces)
        assert (result.content, [(c.name, c.arguments) for c in result.calls]) == (content, calls), pieces


def test_json_formats_make_structural_tags() -> None:
    for cls, trigger in (
        (HermesToolParser, "<tool_call>"),
        (Llama3JsonToolParser, '{"name": '),
        (MistralToolParser, "[TOOL_CALLS]"),
    ):
        tag = cls(TOOLS).structural_tag()
        assert tag is not None and tag["triggers"] == [trigger]
        assert [s["begin"].startswith(trigger) for s in tag["structures"]] == [True, True]
    assert PythonicToolParser(TOOLS).structural_tag() is None and PythonicToolParser(TOOLS).auto_grammar()
    xml = Qwen3XmlToolParser(TOOLS).structural_tag()
    assert xml is not None and xml["triggers"] == ["<tool_call>"] and "grammar" in xml["structures"][0]
    assert MistralToolParser.keeps_special_tokens and not HermesToolParser.keeps_special_tokens


def test_required_and_named_read_the_forced_json() -> None:
    required = RequiredToolParser(TOOLS)
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    )
    whole = required.parse(output, final=True)
    assert [(c.name, c.arguments) for c in whole.calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]
    named = NamedToolParser(TOOLS, "get_weather")
    assert [(c.name, c.arguments) for c in named.parse('  {"city": "Oslo"}', True).calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    for parser, text in ((required, output), (named, '{"city": "Oslo", "days": [1, 2]}')):
        expected = [(c.name, c.arguments) for c in parser.parse(text, True).calls]
        for pieces in chunkings(text, 7):
            result, _ = streamed(parser.parse, pieces)
            assert [(c.name, c.arguments) for c in result.calls] == expected
    schema = required.schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert RequiredToolParser(TOOLS, parallel=False).schema()["maxItems"] == 1
    assert named.schema() == TOOLS[0]["function"]["parameters"]


REASONING_OUTPUTS = [
    # (parser, opened_in_prompt, output, reasoning, content)
    (
        DeepSeekR1ReasoningParser,
        True,
        "I should add.\n</think>\n\nIt is 4.",
        "I should add.\n",
        "\n\nIt is 4.",
    ),
    (DeepSeekR1ReasoningParser, False, "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    (DeepSeekR1ReasoningParser, True, "cut inside the thinking </thi", "cut inside the thinking </thi", ""),
    (Qwen3ReasoningParser, False, "<think>\nplan\n</think>\n\nDone.", "\nplan\n", "\n\nDone."),
    (Qwen3ReasoningParser, False, "No thinking here.", "", "No thinking here."),
    (Qwen3ReasoningParser, True, "opened by the template</think>answer", "opened by the template", "answer"),
    (Qwen3ReasoningParser, True, "still thinking when cut", "still thinking when cut", ""),
    (Qwen3ReasoningParser, False, "<thin", "", "<thin"),
]


@pytest.mark.parametrize("cls, opened, output, reasoning, content", REASONING_OUTPUTS)
def test_reasoning_parsers_streamed_equal_the_whole(cls, opened, output, reasoning, content) -> None:  # type: ignore[no-untyped-def]
    parser = cls(thinking=True, opened_in_prompt=opened)
    whole = parser.parse(output, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for pieces in chunkings(output, 3):
        result, _ = streamed(parser.parse, pieces)
        assert (result.reasoning, result.content) == (reasoning, content), pieces
    assert cls(thinking=False).parse(output, True).content == output  # enable_thinking: false


def test_json_scan_is_prefix_stable() -> None:
    text = '{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": -2.5e3}}'
    assert value_end(text, 0) == len(text)
    full = read_call_object(text, 0)
    assert full is not None and full.complete and full.name == "f"
    for cut in range(len(text)):
        partial = read_call_object(text[:cut], 0)
        assert partial is not None
        assert full.arguments.startswith(partial.arguments)
        assert partial.name in (None, "f")
    assert read_call_object("[1]", 0) is None


def test_a_plugin_file_adds_a_parser(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from frontend.parsers.hermes import HermesToolParser\n"
        "class Mine(HermesToolParser):\n    start_marker = '<call>'\n    end_marker = '</call>'\n"
        "TOOL_PARSERS = {'mine': Mine}\n"
    )
    parsers = Parsers.with_plugin(str(plugin))
    parser = parsers.tool_parser("mine")(TOOLS)
    assert [c.name for c in parser.parse('<call>{"name": "get_time"}</call>', True).calls] == ["get_time"]
    assert "mine" not in Parsers().tool_parsers  # no global registry
    bad = tmp_path / "bad.py"
    bad.write_text("TOOL_PARSERS = {'x': 1}\n")
    with pytest.raises(ValueError, match="TOOL_PARSERS"):
        load_plugin(str(bad))
    with pytest.raises(ValueError, match="unknown tool call parser"):
        Parsers().tool_parser("nope")
