"""Tool-call parsers on recorded-style outputs: whole, and streamed in many cuttings, agree."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit.stream_chunkings import chunkings, fold_extracted, fold_tool_deltas, run_stream
from tokenmill.server.tools import TOOL_PARSERS, get_tool_parser

# (parser, output, expected content, expected [(name, arguments)])
WELL_FORMED = [
    # Qwen2.5-Instruct / Hermes 3
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})],
    ),
    (
        "hermes",
        "I'll check both cities for you.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "東京", "note": "a \\" quote, a } brace, a <tool_call>"}}\n</tool_call>',
        "I'll check both cities for you.",
        [
            ("get_weather", {"city": "Paris"}),
            ("get_weather", {"city": "東京", "note": 'a " quote, a } brace, a <tool_call>'}),
        ],
    ),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, [("get_time", {})]),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "llm", "filters": {"year": [2023, 2024], "open": true}, "limit": 5}}\n</tool_call>',
        None,
        [("search", {"query": "llm", "filters": {"year": [2023, 2024], "open": True}, "limit": 5})],
    ),
    ("hermes", '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", {"x": 1})]),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        None,
        [("f", {"x": 1})],
    ),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", {})]),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nWaiting for the result.',
        "\nWaiting for the result.",
        [("f", {"a": 1})],
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("hermes", "The capital of France is Paris. Use <b>bold</b>, a < sign, <tool_ca.", None, []),
    ("hermes", "Plain answer ending in blanks.\n\n", None, []),
    # Llama 3.1 / 3.2 JSON
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "fahrenheit"}}',
        None,
        [("get_weather", {"city": "San Francisco", "unit": "fahrenheit"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    ("llama3_json", '{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
    ("llama3_json", "The weather in Paris is sunny, {roughly} 20 degrees.", None, []),
    ("llama3_json", '{"answer": 42}', None, []),
    # Mistral: JSON array (v0.3 / Nemo) and the [ARGS] form (Small 3.2)
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
        None,
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "mistral",
        'Let me look that up. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
        "Let me look that up.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        None,
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"tz": "CET"})],
    ),
    ("mistral", "Use [brackets] and [TOOL] tokens wisely.", None, []),
    # Pythonic: Llama 3.2 and Llama 4
    (
        "pythonic",
        '[get_weather(city="San Francisco", metric="celsius")]',
        None,
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})],
    ),
    (
        "pythonic",
        "[get_weather(city='Paris'), get_time(timezone=\"Europe/Paris\", fmt='%H:%M', extra={'a': [1, 2.5, None, True]})]",
        None,
        [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {"timezone": "Europe/Paris", "fmt": "%H:%M", "extra": {"a": [1, 2.5, None, True]}}),
        ],
    ),
    (
        "pythonic",
        '<|python_start|>[search(query="a, b] (c) \\"q\\"", k=3)]<|python_end|>',
        None,
        [("search", {"query": 'a, b] (c) "q"', "k": 3})],
    ),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
    ("pythonic", "Sure! Here is a list: [1, 2, 3].", None, []),
    ("pythonic", "[1, 2, 3]", None, []),
]

# Malformed before any call's name could go out: whole and streamed still agree (all content,
# or the valid calls before the bad part).
MALFORMED_AGREEING = [
    ("hermes", "Checking. <tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    ("hermes", "<tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>[1]</tool_call>'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather")'),
    ("llama3_json", "{not json at all"),
    ("mistral", "[TOOL_CALLS]not a call"),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", '[TOOL_CALLS][{"nom": "f"}]'),
    ("pythonic", "[get_weather(city=paris)]"),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[os.system(cmd="rm -rf /")]'),
    ("pythonic", '[get_weather(**{"city": "Paris"})]'),
    ("pythonic", "[f(x={1, 2})]"),
    ("pythonic", "[]"),
]

# Malformed after a name went out (cut off by max_tokens): whole -> content; streams just don't fail.
MALFORMED_CUT_OFF = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a"'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": '),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", "[f(x=1), 2]"),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), WELL_FORMED)
def test_extract_finds_the_calls(parser, text, content, calls):
    extracted = get_tool_parser(parser).extract(text)
    expected_content = content if calls else text
    assert fold_extracted(extracted) == (expected_content, calls)
    for call in extracted.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, t, _, _ in WELL_FORMED] + MALFORMED_AGREEING)
def test_streaming_in_any_cutting_equals_the_whole_output(parser, text):
    tool_parser = get_tool_parser(parser)
    expected = fold_extracted(tool_parser.extract(text))
    for pieces in chunkings(text):
        assert fold_tool_deltas(run_stream(tool_parser.stream(), pieces)) == expected, pieces


@pytest.mark.parametrize(("parser", "text"), MALFORMED_AGREEING + MALFORMED_CUT_OFF)
def test_malformed_output_is_content_whole_and_never_raises_streamed(parser, text):
    tool_parser = get_tool_parser(parser)
    extracted = tool_parser.extract(text)
    if parser == "hermes" and text.count("<tool_call>") == 2:
        assert [c.name for c in extracted.calls] == ["f"]  # the good call before the bad block stays
    else:
        assert extracted.calls == [] and extracted.content == text
    for pieces in chunkings(text, random_cuts=3):
        run_stream(tool_parser.stream(), pieces)


def test_content_streams_before_the_call_and_marker_prefixes_are_held():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Let me check").content == "Let me check"
    assert stream.feed(" the weather <tool").content == " the weather"  # blank and "<tool" held
    delta = stream.feed('_call>\n{"name": "get_weather", "arguments": {"ci')
    assert delta.content is None
    first = delta.tool_calls[0].to_openai()
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert "".join(d.arguments or "" for d in delta.tool_calls) == '{"ci'
    assert stream.feed('ty": "Paris"}}\n</tool_call>').tool_calls[0].to_openai() == {
        "index": 0,
        "function": {"arguments": 'ty": "Paris"}'},
    }
    assert not stream.finish()


def test_a_held_marker_prefix_that_never_completes_is_content_at_the_end():
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("x [TOOL_").content == "x"
    assert stream.finish().content == " [TOOL_"


def test_ids_and_special_token_needs():
    assert re.fullmatch(r"[A-Za-z0-9]{9}", get_tool_parser("mistral").tool_call_id())
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", get_tool_parser("hermes").tool_call_id())
    assert get_tool_parser("mistral").needs_special_tokens
    assert not get_tool_parser("hermes").needs_special_tokens
    calls = get_tool_parser("mistral").extract(WELL_FORMED[17][1]).calls
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls) and calls[0].id != calls[1].id


def test_registry_names_and_unknown_parser():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    assert all(cls.name == name for name, cls in TOOL_PARSERS.items())
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_feed_after_finish_is_an_error():
    stream = get_tool_parser("hermes").stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


def test_stream_reports_whether_tools_were_called():
    stream = get_tool_parser("llama3_json").stream()
    stream.feed('{"name": "f", "parameters": {}}')
    stream.finish()
    assert stream.tools_called
    plain = get_tool_parser("llama3_json").stream()
    plain.feed("hello")
    plain.finish()
    assert not plain.tools_called
