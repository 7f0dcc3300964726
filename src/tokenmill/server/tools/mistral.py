"""Mistral tool calls, after the `[TOOL_CALLS]` special token, in either of two forms:

- a JSON array (Mistral 7B v0.3, Nemo, Small <= 3.1): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`
- name and arguments (tokenizer v11+, Small 3.2, Magistral), the marker before each call:
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`

Text before the marker is content, as is text after the calls.
"""

from __future__ import annotations

import re

from tokenmill.server.tools.ids import mistral_tool_call_id
from tokenmill.server.tools.json_calls import (
    BAD,
    ArgumentsFollower,
    CallArrayFollower,
    arguments_json,
    call_from_object,
    decode_value,
)
from tokenmill.server.tools.parser_base import ToolCallStream, ToolParser
from tokenmill.server.tools.text_scan import finish_content, skip_ws, text_before_marker
from tokenmill.server.tools.types import ExtractedToolCalls, ToolCall, ToolCallDelta

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARGUMENT_KEYS = ("arguments", "parameters")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _named_call(text: str, pos: int) -> tuple[str, int] | None:
    """(name, index of the arguments' `{`) for `name[ARGS]{` at `pos`, else None."""
    match = _NAME.match(text, pos)
    if match is None or not text.startswith(ARGS, match.end()):
        return None
    args = skip_ws(text, match.end() + len(ARGS))
    return (match.group(), args) if text.startswith("{", args) else None


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens

    def tool_call_id(self) -> str:
        return mistral_tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(MARKER, pos)) >= 0:
            content.append(text[pos:start])
            body = skip_ws(text, start + len(MARKER))
            found = self._extract_array(text, body) if text.startswith("[", body) else None
            if found is None and (named := _named_call(text, body)) is not None:
                decoded = decode_value(text, named[1])
                if decoded is not None and isinstance(decoded[0], dict):
                    found = [ToolCall(self.tool_call_id(), named[0], arguments_json(decoded[0]))], decoded[1]
            if found is None:
                pos = start  # a malformed call and all after it is content
                break
            calls += found[0]
            pos = found[1]
        content.append(text[pos:])
        return ExtractedToolCalls(finish_content(content, bool(calls)), calls)

    def _extract_array(self, text: str, pos: int) -> tuple[list[ToolCall], int] | None:
        decoded = decode_value(text, pos)
        if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
            return None
        calls = [call_from_object(obj, ARGUMENT_KEYS) for obj in decoded[0]]
        if any(call is None for call in calls):
            return None
        return [ToolCall(self.tool_call_id(), *call) for call in calls if call], decoded[1]

    def stream(self) -> MistralStream:
        return MistralStream(self.tool_call_id)


class MistralStream(ToolCallStream):
    def __init__(self, new_id) -> None:
        super().__init__(new_id)
        self._pos = 0
        self._state = "content"  # -> "body" -> "array" | "args" -> "content"; or "plain"
        self._block_start = 0
        self._array: CallArrayFollower | None = None
        self._args: ArgumentsFollower | None = None

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self._state == "content":
                piece, end, found = text_before_marker(text, self._pos, MARKER, final)
                self._emit_content(piece)
                if not found:
                    self._pos = end
                    return
                self._block_start, self._pos, self._state = end, end + len(MARKER), "body"
            elif self._state == "body":
                if not self._start_body(text, final):
                    return
            elif self._state in ("array", "args"):
                follower = self._array if self._state == "array" else self._args
                assert follower is not None
                end = follower.step(text, final)
                if end is None:
                    return
                if end == BAD:
                    # A named call form has gone out at once; an array may have sent some calls.
                    started = self._array is None or self._array.partial_call or self._array.calls_done > 0
                    if started:
                        self._state, self._pos = "dropped", len(text)
                        return
                    self._state, self._pos = "plain", self._block_start
                    continue
                if self._array is not None:
                    if self._array.calls_done == 0:  # `[]`: no call, so content, as in extract()
                        self._array, self._state, self._pos = None, "plain", self._block_start
                        continue
                    self._next_index = self._array.next_index
                self._array = self._args = None
                self._pos, self._state = end, "content"
            elif self._state == "plain":
                self._emit_content(text[self._pos :])
                self._pos = len(text)
                return
            else:  # "dropped": a call cut short; nothing after it can be placed
                self._pos = len(text)
                return

    def _start_body(self, text: str, final: bool) -> bool:
        """Decides what follows a marker; False when that needs more text."""
        pos = skip_ws(text, self._pos)
        if text.startswith("[", pos):
            self._array = CallArrayFollower(pos, self._next_index, ARGUMENT_KEYS, self._new_id, self._calls)
            self._state = "array"
            return True
        named = _named_call(text, pos)
        if named is not None:
            name, args = named
            self._calls.append(ToolCallDelta(self._next_index, id=self._new_id(), name=name, arguments=""))
            self._args = ArgumentsFollower(args, self._next_index, self._calls)
            self._next_index += 1
            self._state = "args"
            return True
        if not final and self._may_become_named_call(text, pos):
            return False
        self._state, self._pos = "plain", self._block_start
        return True

    @staticmethod
    def _may_become_named_call(text: str, pos: int) -> bool:
        match = _NAME.match(text, pos)
        end = match.end() if match else pos
        if end == len(text):
            return True  # blanks, or a name still growing
        tail = text[end:]
        if not match:
            return False
        if tail.startswith(ARGS):
            return skip_ws(text, end + len(ARGS)) == len(text)
        return ARGS.startswith(tail)
