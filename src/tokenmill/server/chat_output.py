"""A chat choice's text -> the assistant message: reasoning (--reasoning-parser) first, then tool
calls (the --tool-call-parser for tool_choice "auto", the forced-call reader for "required" and
named functions), whole or as a stream of OpenAI deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.chat_tools import ToolPlan
from tokenmill.server.protocol import ChatCompletionRequest, DeltaMessage
from tokenmill.server.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from tokenmill.server.reasoning import get_reasoning_parser
from tokenmill.server.state import ServerState
from tokenmill.server.tools import ForcedToolCallStream, StreamDelta, get_tool_parser, parse_forced_output


@dataclass(slots=True)
class ParsedChoice:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def has_content(delta: DeltaMessage) -> bool:
    return bool(delta.content or delta.reasoning_content or delta.tool_calls)


def _to_tool_call(call: Any) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _to_delta_calls(deltas: list[Any]) -> list[DeltaToolCall] | None:
    if not deltas:
        return None
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]


class ChatOutputParsing:
    """One request's way of reading its choices (each choice streams through its own `stream()`)."""

    def __init__(self, plan: ToolPlan, reasoning: Any, in_reasoning: bool, tool_parser: Any) -> None:
        self.plan = plan
        self.reasoning = reasoning  # a reasoning parser, or None
        self.in_reasoning = in_reasoning  # the output starts inside the reasoning
        self.tool_parser = tool_parser  # for "auto"

    @classmethod
    def build(
        cls, state: ServerState, request: ChatCompletionRequest, plan: ToolPlan, prompt_text: str, params: SamplingParams
    ) -> ChatOutputParsing:
        reasoning = get_reasoning_parser(state.reasoning_parser) if state.reasoning_parser else None
        in_reasoning = reasoning is not None and reasoning.starts_in_reasoning(prompt_text)
        in_output = reasoning is not None and not reasoning.reasoning_ended_in_prompt(prompt_text)
        if in_output and params.structured_outputs is not None:
            # The constraint is on the answer: it starts once the model has closed its reasoning.
            end_ids = state.tokenizer("messages").encode(reasoning.end_marker, add_special_tokens=False)
            params.structured_outputs.start_after_token_ids = list(end_ids)
        tool_parser = get_tool_parser(state.tool_call_parser) if plan.mode == "auto" else None
        if tool_parser is not None and tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # its markers are special tokens
        return cls(plan, reasoning, in_reasoning, tool_parser)

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        return "tool_calls" if tools_called and reason == "stop" else reason

    def parse(self, text: str) -> ParsedChoice:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, in_reasoning=self.in_reasoning)
        if self.plan.mode in ("required", "named"):
            forced = parse_forced_output(self.plan.mode, content or "", function_name=self.plan.function_name)
            return ParsedChoice(forced.content, reasoning, [_to_tool_call(c) for c in forced.calls])
        if self.tool_parser is not None and content:
            extracted = self.tool_parser.extract(content)
            return ParsedChoice(extracted.content, reasoning, [_to_tool_call(c) for c in extracted.calls])
        return ParsedChoice(content, reasoning)

    def stream(self) -> ChoiceStream:
        reasoning = self.reasoning.stream(in_reasoning=self.in_reasoning) if self.reasoning is not None else None
        if self.plan.mode in ("required", "named"):
            tools = ForcedToolCallStream(self.plan.mode, self.plan.function_name)
        elif self.tool_parser is not None:
            tools = self.tool_parser.stream()
        else:
            tools = None
        return ChoiceStream(reasoning, tools)


class ChoiceStream:
    """One choice's streaming state: text deltas in, DeltaMessages out."""

    def __init__(self, reasoning: Any, tools: Any) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.tools_called = False

    def feed(self, text: str) -> DeltaMessage:
        reasoning_delta, content = None, text
        if self._reasoning is not None:
            reasoning_delta, content = self._reasoning.feed(text)
        if self._tools is None or not content:
            return DeltaMessage(reasoning_content=reasoning_delta or None, content=content or None)
        return self._merge(DeltaMessage(reasoning_content=reasoning_delta or None), self._tools.feed(content))

    def finish(self, delta: DeltaMessage) -> DeltaMessage:
        """The held-back rest of the output, added to the last delta."""
        if self._reasoning is not None:
            reasoning_rest, content_rest = self._reasoning.finish()
            delta.reasoning_content = (delta.reasoning_content or "") + (reasoning_rest or "") or None
            if content_rest:
                if self._tools is not None:
                    delta = self._merge(delta, self._tools.feed(content_rest))
                else:
                    delta.content = (delta.content or "") + content_rest
        if self._tools is not None:
            delta = self._merge(delta, self._tools.finish())
        return delta

    def _merge(self, delta: DeltaMessage, tool_delta: StreamDelta) -> DeltaMessage:
        if tool_delta.content:
            delta.content = (delta.content or "") + tool_delta.content
        calls = _to_delta_calls(tool_delta.tool_calls)
        if calls:
            self.tools_called = True
            delta.tool_calls = (delta.tool_calls or []) + calls
        return delta
