"""tools / tool_choice checking, the schema of forced calls, and parsing forced outputs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.unit.stream_chunkings import chunkings, fold_extracted, fold_tool_deltas, run_stream
from tokenmill.errors import InvalidRequestError
from tokenmill.server.tools import (
    ForcedToolCallStream,
    forced_tool_schema,
    parse_forced_output,
    resolve_tool_choice,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]


def valid(schema, instance) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def test_defaults_follow_openai():
    assert resolve_tool_choice().mode == "none"
    assert resolve_tool_choice(TOOLS).mode == "auto"
    assert resolve_tool_choice(None, "none").mode == "none"
    choice = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (choice.mode, choice.function_name, choice.parallel_tool_calls, choice.forced) == (
        "named",
        "get_time",
        False,
        True,
    )
    assert choice.tool("get_weather").description == "Current weather in a city"


class _Model:
    """Stands in for a pydantic request model: read through model_dump()."""

    def __init__(self, data):
        self._data = data

    def model_dump(self, exclude_none=False):
        return self._data


def test_request_models_are_read_through_model_dump():
    assert resolve_tool_choice([_Model(WEATHER)], "required").tools[0].name == "get_weather"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param", "words"),
    [
        ([{"type": "retrieval"}], None, "tools[0].type", "only 'function'"),
        ([{"type": "function"}], None, "tools[0].function", "missing"),
        ([{"type": "function", "function": {}}], None, "tools[0].function.name", "missing"),
        (
            [{"type": "function", "function": {"name": "get weather"}}],
            None,
            "tools[0].function.name",
            "letters",
        ),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name", "64"),
        ([WEATHER, WEATHER], None, "tools[1].function.name", "unique"),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "strnig"}}},
                    },
                }
            ],
            None,
            "tools[0].function.parameters",
            "not a valid JSON Schema",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "tools[0].function.parameters",
            "'object'",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            "tools[0].function.parameters",
            "JSON Schema object",
        ),
        ("get_weather", None, "tools", "list"),
        (
            TOOLS,
            {"type": "function", "function": {"name": "get_wether"}},
            "tool_choice",
            "'get_weather', 'get_time'",
        ),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice", "name the function"),
        (TOOLS, "sometimes", "tool_choice", "'required'"),
        (TOOLS, {"type": "code_interpreter"}, "tool_choice", "'function'"),
        (None, "required", "tool_choice", "needs tools"),
        (None, "auto", "tool_choice", "needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, "tool_choice", "no tools"),
    ],
)
def test_bad_requests_name_the_field_and_the_fix(tools, tool_choice, param, words):
    with pytest.raises(InvalidRequestError) as info:
        resolve_tool_choice(tools, tool_choice)
    assert info.value.param == param
    assert words in info.value.message


def test_parallel_tool_calls_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls"):
        resolve_tool_choice(TOOLS, "auto", "yes")


def test_required_schema_takes_calls_of_the_given_tools_only():
    schema = forced_tool_schema(resolve_tool_choice(TOOLS, "required"))
    jsonschema.validators.validator_for(schema).check_schema(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [
            {"name": "get_time", "parameters": {}},
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
        ],
    ]
    bad = [
        [],  # at least one call
        [{"name": "get_wether", "parameters": {"city": "Paris"}}],  # unknown name
        [{"name": "get_weather", "parameters": {}}],  # missing required argument
        [{"name": "get_weather", "parameters": {"city": "Paris", "zip": 1}}],  # not in that tool's schema
        [{"name": "get_time", "parameters": {"city": "Paris"}, "extra": 1}],  # extra key
        [{"name": "get_time"}],  # parameters required
        {"name": "get_time", "parameters": {}},  # not an array
    ]
    assert all(valid(schema, g) for g in good)
    assert not any(valid(schema, b) for b in bad)


def test_required_without_parallel_calls_allows_exactly_one():
    schema = forced_tool_schema(resolve_tool_choice(TOOLS, "required", parallel_tool_calls=False))
    one = [{"name": "get_time", "parameters": {}}]
    assert valid(schema, one) and not valid(schema, one * 2)


def test_named_schema_is_the_functions_arguments():
    weather = forced_tool_schema(
        resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    )
    assert valid(weather, {"city": "Paris"}) and not valid(weather, {"town": "Paris"})
    time = forced_tool_schema(
        resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    )
    assert time == {"type": "object", "properties": {}}
    assert forced_tool_schema(resolve_tool_choice(TOOLS, "auto")) is None


def test_required_schema_lifts_definitions_so_references_resolve():
    with_defs = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "$defs": {"Date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
                "properties": {"day": {"$ref": "#/$defs/Date"}},
                "required": ["day"],
            },
        },
    }
    schema = forced_tool_schema(resolve_tool_choice([with_defs, TIME], "required"))
    assert valid(schema, [{"name": "book", "parameters": {"day": "2025-01-31"}}])
    assert not valid(schema, [{"name": "book", "parameters": {"day": "tomorrow"}}])
    clash = json.loads(json.dumps(with_defs))
    clash["function"]["name"] = "book2"
    clash["function"]["parameters"]["$defs"]["Date"] = {"type": "integer"}
    with pytest.raises(InvalidRequestError, match="Date"):
        forced_tool_schema(resolve_tool_choice([with_defs, clash], "required"))


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
    '[{"name":"get_weather","parameters":{"city":"a ] } \\" ["}},{"name":"get_time","parameters":{}}]',
    ' [ {"name": "get_time", "parameters": {}} ] ',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_output_whole_and_streamed(text):
    expected = fold_extracted(parse_forced_output("required", text))
    assert expected[0] is None and expected[1] == [(o["name"], o["parameters"]) for o in json.loads(text)]
    for pieces in chunkings(text):
        # fold_tool_deltas parses each call's joined fragments: an outer `,` or `]` would break it
        assert fold_tool_deltas(run_stream(ForcedToolCallStream("required"), pieces)) == expected, pieces


@pytest.mark.parametrize("text", ['{"city": "Paris"}', ' {"city": "Par\\u00eds", "unit": "celsius"}\n'])
def test_named_output_whole_and_streamed(text):
    expected = fold_extracted(parse_forced_output("named", text, function_name="get_weather"))
    assert expected == (None, [("get_weather", json.loads(text))])
    for pieces in chunkings(text):
        assert fold_tool_deltas(run_stream(ForcedToolCallStream("named", "get_weather"), pieces)) == expected


def test_named_stream_sends_id_and_name_with_the_first_text():
    stream = ForcedToolCallStream("named", "get_weather")
    first = stream.feed('{"ci').tool_calls
    assert first[0].name == "get_weather" and first[0].id.startswith("call_")
    assert first[0].arguments == '{"ci'


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("required", '[{"name": "get_weather", "parameters": {"ci'),
        ("required", "[]"),
        ("named", '{"city": '),
        ("named", "[1]"),
    ],
)
def test_unfinished_forced_output_is_content(kind, text):
    assert parse_forced_output(kind, text, function_name="get_weather").content == text
    for pieces in chunkings(text, random_cuts=2):
        run_stream(ForcedToolCallStream(kind, "get_weather"), pieces)


def test_required_output_cut_by_max_tokens_keeps_its_complete_calls():
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}, {"name":"get_we'
    extracted = parse_forced_output("required", text)
    assert extracted.content is None
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
