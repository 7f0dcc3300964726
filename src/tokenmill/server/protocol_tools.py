"""Tool calling in chat bodies: the tools a request offers, the calls an assistant message made,
and the calls a response (or a stream's deltas) carries, in OpenAI's shapes."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tokenmill.server.request_model import OpenAIModel, RequestModel

# ----------------------------------------------------------------------------- in requests


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # tokenmill enforces forced calls' schemas either way


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(RequestModel):
    name: str
    arguments: str = "{}"


class MessageToolCall(RequestModel):
    """A call an earlier assistant message made (sent back by the client with the tool's result)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict[str, Any]:
        # Chat templates index the arguments (`tool_call.arguments | items`) or dump them with
        # tojson: they expect an object, where OpenAI's messages carry its JSON text.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


# ----------------------------------------------------------------------------- in responses


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall = Field(default_factory=DeltaFunctionCall)
