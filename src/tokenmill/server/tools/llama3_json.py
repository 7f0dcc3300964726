"""Llama 3.1 / 3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`.

The output is calls only when it starts (after blanks) with `<|python_tag|>` or `{`; any
other output is plain content. Text after the last call is content.
"""

from __future__ import annotations

from tokenmill.server.tools.json_calls import BAD, CallFollower, call_from_object, decode_value
from tokenmill.server.tools.parser_base import ToolCallStream, ToolParser
from tokenmill.server.tools.text_scan import finish_content, skip_ws
from tokenmill.server.tools.types import ExtractedToolCalls, ToolCall

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


def _calls_start(text: str) -> int | None:
    """Where the first call object may start, or None if the output is plain content."""
    pos = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = skip_ws(text, pos + len(PYTHON_TAG))
    return pos if text.startswith("{", pos) else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    # <|python_tag|> is a special token; without it kept the parser still sees the JSON.
    needs_special_tokens = False

    def extract(self, text: str) -> ExtractedToolCalls:
        pos = _calls_start(text)
        if pos is None:
            return ExtractedToolCalls(text or None)
        calls: list[ToolCall] = []
        content = [text[: skip_ws(text, 0)]]  # blanks before the calls count as content
        while True:
            decoded = decode_value(text, pos)
            call = call_from_object(decoded[0], ARGUMENT_KEYS) if decoded else None
            if call is None:
                if not calls:
                    return ExtractedToolCalls(text or None)
                break
            calls.append(ToolCall(self.tool_call_id(), *call))
            assert decoded is not None
            pos = decoded[1]
            after = skip_ws(text, pos)
            if not text.startswith(";", after):
                break
            nxt = skip_ws(text, after + 1)
            if not text.startswith("{", nxt):
                pos = after + 1  # a trailing `;`: what follows is content
                break
            pos = nxt
        content.append(text[pos:])
        return ExtractedToolCalls(finish_content(content, True), calls)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self.tool_call_id)


class Llama3JsonStream(ToolCallStream):
    def __init__(self, new_id) -> None:
        super().__init__(new_id)
        self._pos = 0
        self._state = "start"  # -> "call" -> "after" -> ("next" -> "call") ... or "plain"
        self._call: CallFollower | None = None

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self._state == "start":
                pos = skip_ws(text, 0)
                rest = text[pos:]
                if rest.startswith(PYTHON_TAG):
                    pos = skip_ws(text, pos + len(PYTHON_TAG))
                    rest = text[pos:]
                    if not rest and not final:
                        return
                elif not final and PYTHON_TAG.startswith(rest):  # also: nothing but blanks yet
                    return
                if not rest.startswith("{"):
                    self._state, self._pos = "plain", 0
                    continue
                self._start_call(pos)
            elif self._state == "call":
                assert self._call is not None
                end = self._call.step(text, final)
                if end is None:
                    return
                if end == BAD:
                    if self._call.named:
                        self._state, self._pos = "dropped", len(text)
                        return
                    # Only the first call can fail unnamed here: later ones start after a `;` +
                    # `{` and extract() treats a bad one like this (the rest is content).
                    self._state, self._pos = "plain", (0 if self._next_index == 1 else self._call.start)
                    continue
                if self._next_index == 1:  # blanks before the calls count as content, as in extract()
                    self._emit_content(text[: skip_ws(text, 0)])
                self._pos, self._state = end, "after"
            elif self._state in ("after", "next"):
                pos = skip_ws(text, self._pos)
                if pos == len(text) and not final:
                    return
                expected = ";" if self._state == "after" else "{"
                if not text.startswith(expected, pos):
                    self._state = "plain"  # content follows the calls (from _pos, blanks included)
                elif expected == ";":
                    self._pos, self._state = pos + 1, "next"
                else:
                    self._start_call(pos)
            elif self._state == "plain":
                self._emit_content(text[self._pos :])
                self._pos = len(text)
                return
            else:  # "dropped": a call cut short; nothing after it can be placed
                self._pos = len(text)
                return

    def _start_call(self, pos: int) -> None:
        self._call = CallFollower(pos, self._next_index, ARGUMENT_KEYS, self._new_id, self._calls)
        self._next_index += 1
        self._state = "call"
