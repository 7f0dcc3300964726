"""The JSON Schema that constrains the output when tool_choice forces calls.

- named function: the output is that function's arguments object;
- "required": a JSON array of `{"name": <one tool>, "parameters": <its arguments>}`, one anyOf
  branch per tool so each name goes with its own schema; at least one call, exactly one when
  parallel_tool_calls is false.

Tools' `$defs` / `definitions` move to the top of the combined schema, where their
`#/$defs/...` references point once the tool schema sits inside the array.
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.server.tools.tool_choice import FunctionTool, ToolChoice

DEFINITION_KEYS = ("$defs", "definitions")


def forced_tool_schema(choice: ToolChoice) -> dict[str, Any] | None:
    """The schema for the output of a forced choice; None when the output is free."""
    if choice.mode == "named":
        tool = choice.tool(choice.function_name or "")
        assert tool is not None, "resolve_tool_choice checked the name"
        return tool.arguments_schema
    if choice.mode == "required":
        return required_calls_schema(choice.tools, choice.parallel_tool_calls)
    return None


def required_calls_schema(
    tools: tuple[FunctionTool, ...], parallel_tool_calls: bool = True
) -> dict[str, Any]:
    definitions: dict[str, dict[str, Any]] = {key: {} for key in DEFINITION_KEYS}
    branches = []
    for tool in tools:
        arguments = dict(tool.arguments_schema)
        for key in DEFINITION_KEYS:
            for def_name, schema in (arguments.pop(key, None) or {}).items():
                if definitions[key].setdefault(def_name, schema) != schema:
                    raise InvalidRequestError(
                        f"tools define {key}/{def_name} differently (one is in {tool.name!r}); "
                        "tool_choice 'required' needs each definition name to mean one schema",
                        param="tools",
                    )
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": arguments},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    for key in DEFINITION_KEYS:
        if definitions[key]:
            schema[key] = definitions[key]
    return schema
