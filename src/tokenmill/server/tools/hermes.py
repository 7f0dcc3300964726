"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Several blocks may follow each other; text before, between and after them is content. The
closing tag of the last block may be missing (generation stopped on it or on EOS).
"""

from __future__ import annotations

from tokenmill.server.tools.json_calls import BAD, CallFollower, call_from_object, decode_value
from tokenmill.server.tools.parser_base import ToolCallStream, ToolParser
from tokenmill.server.tools.text_scan import finish_content, skip_ws, text_before_marker
from tokenmill.server.tools.types import ExtractedToolCalls, ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


def _block_end(text: str, after_object: int) -> int:
    """Where content resumes after a block whose JSON ended at `after_object`: past
    `</tool_call>`, or (tag missing: stopped there, or the model went on without it) right
    after the JSON."""
    pos = skip_ws(text, after_object)
    return pos + len(CLOSE) if text.startswith(CLOSE, pos) else after_object


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(OPEN, pos)) >= 0:
            content.append(text[pos:start])
            obj_start = skip_ws(text, start + len(OPEN))
            decoded = decode_value(text, obj_start) if text.startswith("{", obj_start) else None
            call = call_from_object(decoded[0], ARGUMENT_KEYS) if decoded else None
            if call is None:
                pos = start  # a malformed block and all after it is content
                break
            calls.append(ToolCall(self.tool_call_id(), *call))
            pos = _block_end(text, decoded[1])
        content.append(text[pos:])
        return ExtractedToolCalls(finish_content(content, bool(calls)), calls)

    def stream(self) -> HermesStream:
        return HermesStream(self.tool_call_id)


class HermesStream(ToolCallStream):
    def __init__(self, new_id) -> None:
        super().__init__(new_id)
        self._pos = 0
        self._state = "content"  # -> "open" (after <tool_call>) -> "call" -> "close" -> "content"
        self._block_start = 0
        self._call: CallFollower | None = None

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self._state == "content":
                piece, end, found = text_before_marker(text, self._pos, OPEN, final)
                self._emit_content(piece)
                if not found:
                    self._pos = end
                    return
                self._block_start = end
                self._pos = end + len(OPEN)
                self._state = "open"
            elif self._state == "open":
                pos = skip_ws(text, self._pos)
                if pos == len(text) and not final:
                    return
                if not text.startswith("{", pos):
                    return self._malformed(final)
                self._call = CallFollower(pos, self._next_index, ARGUMENT_KEYS, self._new_id, self._calls)
                self._next_index += 1
                self._state = "call"
            elif self._state == "call":
                assert self._call is not None
                end = self._call.step(text, final)
                if end is None:
                    return
                if end == BAD:
                    return self._malformed(final)
                self._pos = end
                self._state = "close"
            elif self._state == "close":
                pos = skip_ws(text, self._pos)
                rest = text[pos:]
                if not final and CLOSE.startswith(rest):
                    return
                if rest.startswith(CLOSE):
                    self._pos = pos + len(CLOSE)
                # else: no closing tag; what follows the JSON is content, as in extract()
                self._call = None
                self._state = "content"
            elif self._state == "plain":  # the rest of the output is content
                self._emit_content(text[self._pos :])
                self._pos = len(text)
                return
            else:  # "dropped": a call cut short; nothing after it can be placed
                self._pos = len(text)
                return

    def _malformed(self, final: bool) -> None:
        if self._call is not None and self._call.named:
            # Its name (maybe some arguments) went out: the rest of this block can't become content.
            self._state = "dropped"
            self._pos = len(self.text)
            return
        self._call = None
        self._state = "plain"
        self._pos = self._block_start
        self._advance(final)
