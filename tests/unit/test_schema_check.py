"""The API server's JSON Schema check: a schema that passed is not walked against the metaschema
again (the walk costs milliseconds on the event loop), and a bad one is refused every time."""

from __future__ import annotations

import jsonschema
import jsonschema.validators
import pytest

from tokenmill.server.schema_check import SchemaChecker, canonical_text

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}
REORDERED = {"required": ["a"], "properties": {"a": {"minimum": 0, "type": "integer"}}, "type": "object"}
BAD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}


@pytest.fixture
def walks(monkeypatch) -> list[object]:
    """Each metaschema walk (check_schema of the validator class the test schemas get), recorded."""
    seen: list[object] = []
    validator = jsonschema.validators.validator_for(SCHEMA)
    real = validator.check_schema

    def counting(schema, *args, **kwargs):
        seen.append(schema)
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(validator, "check_schema", counting)
    return seen


def test_an_equal_schema_is_checked_once(walks):
    checker = SchemaChecker()
    for _ in range(3):
        checker.check(SCHEMA)
    checker.check(REORDERED)  # the same JSON value, keys in another order
    assert len(walks) == 1
    assert checker.hits == 3 and len(checker) == 1
    checker.check({**SCHEMA, "required": []})  # a different schema is walked
    assert len(walks) == 2


def test_a_bad_schema_is_refused_every_time_and_never_remembered(walks):
    checker = SchemaChecker()
    for _ in range(2):
        with pytest.raises(jsonschema.SchemaError) as caught:
            checker.check(BAD)
        assert list(caught.value.path) == ["properties", "a", "minimum"]
    assert len(walks) == 2 and len(checker) == 0
    checker.check(SCHEMA)  # a good one after it is still remembered
    checker.check(SCHEMA)
    assert len(walks) == 3


def test_the_least_recently_used_schema_goes_first(walks):
    checker = SchemaChecker(capacity=2)
    schemas = [{"type": "string", "maxLength": n} for n in range(3)]
    checker.check(schemas[0])
    checker.check(schemas[1])
    checker.check(schemas[0])  # used again: schemas[1] is now the oldest
    checker.check(schemas[2])  # evicts schemas[1]
    assert len(checker) == 2 and len(walks) == 3
    checker.check(schemas[0])
    assert len(walks) == 3
    checker.check(schemas[1])
    assert len(walks) == 4


def test_the_cache_holds_a_bounded_amount_of_text(walks):
    big = {"type": "string", "description": "x" * 100}
    checker = SchemaChecker(max_chars=3 * len(canonical_text(big)) // 2)
    checker.check(SCHEMA)
    checker.check(big)  # together over the bound: SCHEMA, the oldest, goes
    assert len(checker) == 1 and len(walks) == 2
    checker.check(big)
    assert len(walks) == 2
    huge = {"type": "string", "description": "x" * 1000}  # alone over the bound: never kept
    checker.check(huge)
    checker.check(huge)
    assert len(walks) == 4 and len(checker) == 1


def test_canonical_text_tells_values_apart():
    assert canonical_text(SCHEMA) == canonical_text(REORDERED)
    assert canonical_text({"maximum": 1}) != canonical_text({"maximum": 1.5})
    assert canonical_text({"const": True}) != canonical_text({"const": 1})
    assert canonical_text(True) != canonical_text(False)
