"""The compile cache's key: equal constraints share one compile, different ones never do."""

from __future__ import annotations

from tokenmill.engine.structured_output.backend import clean_error, grammar_key
from tokenmill.sampling_params import StructuredOutputsParams as SO


def test_equal_specs_share_a_key_and_different_ones_do_not():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    text = '{"type": "object",\n "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}'
    assert grammar_key(SO(json=schema)) == grammar_key(SO(json=text))
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert grammar_key(SO(json=schema)) != grammar_key(SO(json=reordered))  # field order is output order
    assert grammar_key(SO(json=schema)) != grammar_key(SO(json=schema, disable_any_whitespace=True))
    assert grammar_key(SO(regex="a|b")) != grammar_key(SO(grammar="a|b"))
    assert grammar_key(SO(choice=["a", "b"])) != grammar_key(SO(choice=["b", "a"]))
    assert grammar_key(SO(json="{not json")) == ("json", "{not json", True)


def test_clean_error_drops_the_cpp_location():
    raw = "[17:05:19] /project/cpp/regex_converter.cc:83: Regex parsing error at position 4: not closed."
    assert clean_error(RuntimeError(raw)) == "Regex parsing error at position 4: not closed."
    raw = "[17:05:19] /p/x.cc:1207: Check failed: (a) is false: Invalid structural tag"
    assert clean_error(RuntimeError(raw)) == "Invalid structural tag"
