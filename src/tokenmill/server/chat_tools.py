"""What a chat request's `tools` and `tool_choice` ask of this server.

- no tools, or tool_choice "none": the model writes text (tools still go to the template);
- "auto" (the default with tools): the model decides; its calls are read from the output by the
  --tool-call-parser, so without one (and --enable-auto-tool-choice) the request is a 400, as in
  vLLM, instead of tools the model never sees called;
- "required" or a named function: a grammar built from the functions' parameter schemas forces
  the output, so the arguments always parse and validate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.state import ServerState
from tokenmill.server.tools import tool_choice as forced_calls

ToolMode = Literal["off", "none", "auto", "required", "named"]


@dataclass(slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[dict[str, Any]] = field(default_factory=list)
    function_name: str | None = None  # the named function
    parallel_tool_calls: bool = True
    constraint: StructuredOutputsParams | None = None  # forced modes only

    @property
    def choice_name(self) -> str:
        return repr(self.function_name) if self.mode == "named" else repr(self.mode)


def plan_tools(state: ServerState, request: ChatCompletionRequest) -> ToolPlan:
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools; send tools or leave tool_choice out", param="tool_choice")
        return ToolPlan("off")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    named = None if choice is None or isinstance(choice, str) else choice.model_dump(exclude_none=True)
    # Checks names, duplicates, parameter schemas and the named function (400s naming the field).
    forced_calls.validate_tools(tools, named if named is not None else choice)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice is None or choice == "auto":
        if not (state.enable_auto_tool_choice and state.tool_call_parser):
            raise InvalidRequestError(
                '"auto" tool choice (the default when tools are given) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser; send tool_choice \"required\", a named "
                'function or "none" instead',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parallel_tool_calls=request.parallel_tool_calls)
    if choice == "required":
        schema = forced_calls.required_schema(tools, parallel_tool_calls=request.parallel_tool_calls)
        return ToolPlan(
            "required",
            tools,
            parallel_tool_calls=request.parallel_tool_calls,
            constraint=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
    assert named is not None
    name = named["function"]["name"]
    schema = forced_calls.named_schema(tools, name)
    return ToolPlan(
        "named", tools, function_name=name, constraint=StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    )
