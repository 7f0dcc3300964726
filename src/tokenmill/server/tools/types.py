"""The values tool-call parsers hand the server: finished calls, and the deltas of a stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCall:
    """One finished call; `arguments` is JSON text of an object, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ExtractedToolCalls:
    """A whole output split into what the user reads (`content`) and the calls the model made."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@dataclass(slots=True)
class ToolCallDelta:
    """One step of call `index` in a stream: its first delta has `id` and `name`, later ones
    only `arguments` fragments, whose concatenation is the call's arguments JSON."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The `choices[].delta.tool_calls[]` entry of a chat completion chunk."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        if function:
            out["function"] = function
        return out


@dataclass(slots=True)
class StreamDelta:
    """What one `feed()` released: new content text and tool-call deltas (either may be empty)."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Joins consecutive deltas of one call, so a chunk carries one entry per call."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == d.index and d.id is None and d.name is None:
            if d.arguments:
                last.arguments = (last.arguments or "") + d.arguments
            continue
        merged.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return merged
