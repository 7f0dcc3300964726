"""The request fields that constrain an output: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, all turned into one `StructuredOutputsParams`.

A request may use one of them; two are a 400 naming both. JSON schemas are checked here, in the
API server (a 400 before the request is admitted); regexes and grammars are compiled by the
engine, whose "invalid structured output: ..." errors the handlers turn into a 400 as well.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import Field, field_validator, model_validator

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.request_model import RequestModel, refuse
from tokenmill.server.schema_check import SCHEMAS

# Backends a request may name: the one tokenmill has, and vLLM's "let the server choose".
ACCEPTED_BACKENDS = ("auto", "xgrammar")


def check_json_schema(schema: Any, param: str) -> dict[str, Any] | bool:
    """A JSON Schema given as an object or as its JSON text, checked against its metaschema (once
    per distinct schema: schema_check.py)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{param} must be a JSON Schema object", param=param)
    try:
        SCHEMAS.check(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise InvalidRequestError(
            f"{param} is not a valid JSON Schema ({where}): {exc.message}", param=param
        ) from exc
    return schema


class JsonSchemaFormat(RequestModel):
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # OpenAI's strict=false asks for best effort; tokenmill always enforces the schema, which a
    # strict client wants and a lenient one does not mind.
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag, in either of xgrammar's layouts (structures + triggers, or format).
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type == "structural_tag" and self.structures is None and self.format is None:
            raise ValueError("response_format of type structural_tag needs structures and triggers, or format")
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is one backend: nothing to fall back to, as asked
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> StructuredOutputsRequest:
        if self.whitespace_pattern is not None:
            raise refuse("structured_outputs.whitespace_pattern", "use disable_any_whitespace for compact JSON")
        if self.disable_additional_properties:
            raise refuse(
                "structured_outputs.disable_additional_properties",
                "put additionalProperties: false into the schema itself",
            )
        if self.backend is not None and self.backend not in ACCEPTED_BACKENDS:
            raise refuse("structured_outputs.backend", f"the backend is xgrammar; send one of {ACCEPTED_BACKENDS}")
        return self


class StructuredOutputFields(RequestModel):
    """The constraint fields shared by chat and completions requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("guided_decoding_backend")
    @classmethod
    def _known_backend(cls, backend: str | None) -> str | None:
        if backend is not None and backend not in ACCEPTED_BACKENDS:
            raise ValueError(f"guided_decoding_backend must be one of {ACCEPTED_BACKENDS}, got {backend!r}")
        return backend

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported; use structured_outputs.disable_any_whitespace")
        return pattern

    def constraint_fields(self) -> list[str]:
        """The fields of this request that constrain its output."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        given.extend(
            name
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        )
        return given

    @property
    def constraint_param(self) -> str | None:
        """The field the request's constraint came from (errors about it name this field)."""
        given = self.constraint_fields()
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        given = self.constraint_fields()
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(
                f"a request may constrain its output one way; it has {' and '.join(given)}", param=given[1]
            )
        field = given[0]
        if field == "response_format":
            return self._from_response_format()
        if field == "structured_outputs":
            return self._from_structured_outputs()
        value = getattr(self, field)
        if field == "guided_json":
            return _params(field, json=check_json_schema(value, field))
        return _params(field, **{field.removeprefix("guided_"): value})

    def _from_response_format(self) -> StructuredOutputsParams:
        fmt = self.response_format
        assert fmt is not None
        if fmt.type == "json_object":
            return _params("response_format", json_object=True)
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None
            schema = check_json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
            return _params("response_format", json=schema)
        tag = fmt.model_dump(exclude_none=True, exclude={"json_schema"})
        return _params("response_format", structural_tag=json.dumps(tag))

    def _from_structured_outputs(self) -> StructuredOutputsParams:
        so = self.structured_outputs
        assert so is not None
        json_schema = so.json_
        if json_schema is not None:
            json_schema = check_json_schema(json_schema, "structured_outputs.json")
        tag = so.structural_tag
        return _params(
            "structured_outputs",
            json=json_schema,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=so.json_object,
            structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
            disable_any_whitespace=so.disable_any_whitespace,
        )


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as exc:
        # Name the field the client used, not the engine-side one.
        raise InvalidRequestError(exc.message.replace("structured_outputs", param, 1), param=param) from exc
