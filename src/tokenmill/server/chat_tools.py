"""What a chat request's `tools` and `tool_choice` ask of this server.

- no tools, or tool_choice "none": the model writes text (tools still go to the template);
- "auto" (the default with tools): the model decides; its calls are read from the output by the
  --tool-call-parser, so without one (and --enable-auto-tool-choice) the request is a 400, as in
  vLLM, instead of tools the model never sees called;
- "required" or a named function: a grammar built from the functions' parameter schemas forces
  the output, so the arguments always parse and validate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.state import ServerState
from tokenmill.server.tools import ToolChoice, forced_tool_schema, resolve_tool_choice


@dataclass(slots=True)
class ToolPlan:
    choice: ToolChoice
    constraint: StructuredOutputsParams | None = None  # forced modes only

    @property
    def mode(self) -> str:
        return self.choice.mode

    @property
    def function_name(self) -> str | None:
        return self.choice.function_name

    @property
    def choice_name(self) -> str:
        return repr(self.function_name) if self.mode == "named" else repr(self.mode)


def plan_tools(state: ServerState, request: ChatCompletionRequest) -> ToolPlan:
    choice = resolve_tool_choice(request.tools or None, request.tool_choice, request.parallel_tool_calls)
    if choice.mode == "auto" and not (state.enable_auto_tool_choice and state.tool_call_parser):
        raise InvalidRequestError(
            '"auto" tool choice (the default when tools are given) needs the server started with '
            '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "required", a named '
            'function or "none" instead',
            param="tool_choice",
        )
    if not choice.forced:
        return ToolPlan(choice)
    schema = forced_tool_schema(choice)
    # Compact JSON: a sampled model cannot wander off into whitespace between the arguments.
    return ToolPlan(choice, StructuredOutputsParams(json=schema, disable_any_whitespace=True))
