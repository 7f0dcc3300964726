"""Turning the constrained output of a forced tool_choice into tool calls, whole or streamed.

The output follows `forced_tool_schema`: for a named function it is the arguments object, for
"required" the array `[{"name": ..., "parameters": {...}}, ...]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from tokenmill.server.tools.ids import openai_tool_call_id
from tokenmill.server.tools.json_calls import (
    ArgumentsFollower,
    CallArrayFollower,
    arguments_json,
    call_from_object,
)
from tokenmill.server.tools.parser_base import ToolCallStream
from tokenmill.server.tools.text_scan import skip_ws
from tokenmill.server.tools.types import ExtractedToolCalls, ToolCall, ToolCallDelta

ForcedKind = Literal["named", "required"]
REQUIRED_ARGUMENT_KEYS = ("parameters",)


def parse_forced_output(
    kind: ForcedKind,
    text: str,
    *,
    function_name: str | None = None,
    new_id: Callable[[], str] = openai_tool_call_id,
) -> ExtractedToolCalls:
    """The calls in a whole forced output. A "required" array that max_tokens cut short keeps its
    complete calls (as its stream sent them); other output the grammar could not finish has no
    calls: it comes back as content, so the user still sees it."""
    calls = _calls(kind, text, function_name)
    if calls is None:
        return ExtractedToolCalls(text or None)
    return ExtractedToolCalls(None, [ToolCall(new_id(), name, arguments) for name, arguments in calls])


def _complete_elements(text: str) -> list[object]:
    """The array elements that are whole in a truncated `[elem, elem, ...` text."""
    decoder = json.JSONDecoder()
    pos = skip_ws(text, 0)
    if not text.startswith("[", pos):
        return []
    elements: list[object] = []
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return elements
        elements.append(value)
        pos = skip_ws(text, pos)
        if not text.startswith(",", pos):
            return elements
        pos += 1


def _calls(kind: ForcedKind, text: str, function_name: str | None) -> list[tuple[str, str]] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if kind != "required":
            return None
        value = _complete_elements(text)
    if kind == "named":
        if function_name is None:
            raise ValueError("a named tool_choice needs function_name")
        arguments = arguments_json(value) if isinstance(value, dict) else None
        return None if arguments is None else [(function_name, arguments)]
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(obj, REQUIRED_ARGUMENT_KEYS) for obj in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


class ForcedToolCallStream(ToolCallStream):
    """Streams the calls of a forced output as OpenAI tool-call deltas.

    Named: the call's id and name go out with the first text (they are known up front), then
    the arguments object as it grows. Required: each array element's name goes out once its
    `"name": "..."` has arrived, then its `parameters` object; the array's own brackets and
    commas never reach an arguments fragment. Nothing goes out as content.
    """

    def __init__(
        self,
        kind: ForcedKind,
        function_name: str | None = None,
        new_id: Callable[[], str] = openai_tool_call_id,
    ) -> None:
        super().__init__(new_id)
        if kind == "named" and not function_name:
            raise ValueError("a named tool_choice needs function_name")
        self.kind = kind
        self.function_name = function_name
        self._follower: ArgumentsFollower | CallArrayFollower | None = None
        self._done = False

    def _advance(self, final: bool) -> None:
        if self._done:
            return
        if self.kind == "named" and self._next_index == 0:
            self._calls.append(ToolCallDelta(0, id=self._new_id(), name=self.function_name, arguments=""))
            self._next_index = 1
        if self._follower is None:
            start = skip_ws(self.text, 0)
            if start == len(self.text):
                return
            opener = "{" if self.kind == "named" else "["
            if self.text[start] != opener:
                self._done = True  # not what the grammar allows; nothing to stream
                return
            if self.kind == "named":
                self._follower = ArgumentsFollower(start, 0, self._calls)
            else:
                self._follower = CallArrayFollower(
                    start, 0, REQUIRED_ARGUMENT_KEYS, self._new_id, self._calls
                )
        if self._follower.step(self.text, final) is not None:
            self._done = True  # complete (what follows is the grammar's trailing blanks), or BAD
