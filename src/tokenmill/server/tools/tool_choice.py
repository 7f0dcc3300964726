"""Checking a request's `tools`, `tool_choice` and `parallel_tool_calls`, and what they resolve to.

Requests arrive as plain JSON (dicts); objects with `model_dump()` (the server's pydantic
models) are read through it, so this module needs no pydantic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from tokenmill.errors import InvalidRequestError
from tokenmill.server.schema_check import SCHEMAS

# OpenAI's rule for function names; the chat templates and parsers rely on names being simple.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object; None: no arguments
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A checked request: `mode` is "named" when tool_choice names one function (`function_name`)."""

    mode: Mode
    tools: tuple[FunctionTool, ...] = ()
    function_name: str | None = None
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        """The output is constrained to tool calls (the server builds `forced_tool_schema`)."""
        return self.mode in ("required", "named")

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


def parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be a list of tools, got {type(tools).__name__}", param="tools")
    parsed: list[FunctionTool] = []
    seen: set[str] = set()
    for i, raw in enumerate(tools):
        tool = _plain(raw)
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(
                f"{where} must be an object like {{'type': 'function', 'function': {{...}}}}", param=where
            )
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{where}.type is {tool.get('type')!r}; only 'function' tools are supported",
                param=f"{where}.type",
            )
        function = _plain(tool.get("function"))
        if not isinstance(function, dict):
            raise InvalidRequestError(
                f"{where}.function is missing: give an object with at least a 'name'",
                param=f"{where}.function",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.function.name is missing", param=f"{where}.function.name")
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name {name!r} is invalid: use 1 to 64 letters, digits, underscores or dashes",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where}.function.name {name!r} is given twice: tool names must be unique",
                param=f"{where}.function.name",
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{where}.function.description must be a string", param=f"{where}.function.description"
            )
        parameters = _check_parameters(function.get("parameters"), f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(
                f"{where}.function.strict must be true or false", param=f"{where}.function.strict"
            )
        parsed.append(FunctionTool(name, description, parameters, strict))
    return tuple(parsed)


def _check_parameters(parameters: Any, where: str) -> dict[str, Any] | None:
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"{where} must be a JSON Schema object such as {{'type': 'object', 'properties': {{...}}}}",
            param=where,
        )
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(
            f"{where} has type {kind!r}: the arguments of a call are a JSON object, so use type 'object'",
            param=where,
        )
    try:
        SCHEMAS.check(parameters)  # once per distinct schema: agents send the same tools every turn
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise InvalidRequestError(
            f"{where} is not a valid JSON Schema: {e.message} (at {path or 'the top'})", param=where
        ) from None
    return parameters


def resolve_tool_choice(
    tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None
) -> ToolChoice:
    """Checks the three request fields and resolves the defaults OpenAI applies: "auto" with
    tools, "none" without."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    parsed = parse_tools(tools) if tools is not None else ()
    choice = _plain(tool_choice)
    if choice is None:
        return ToolChoice("auto" if parsed else "none", parsed, parallel_tool_calls=parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice {choice!r} is invalid: use 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        if choice != "none" and not parsed:
            raise InvalidRequestError(
                f"tool_choice {choice!r} needs tools: give a non-empty 'tools' list", param="tool_choice"
            )
        return ToolChoice(choice, parsed, parallel_tool_calls=parallel)  # type: ignore[arg-type]
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    function = _plain(choice.get("function"))
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            "tool_choice.function.name is missing: name the function to call", param="tool_choice"
        )
    if not parsed:
        raise InvalidRequestError(
            f"tool_choice names function {name!r} but no tools are given", param="tool_choice"
        )
    if not any(t.name == name for t in parsed):
        known = ", ".join(repr(t.name) for t in parsed)
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not among the tools ({known})",
            param="tool_choice",
        )
    return ToolChoice("named", parsed, function_name=name, parallel_tool_calls=parallel)
