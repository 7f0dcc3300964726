"""Pythonic tool calls (Llama 3.2 / Llama 4, ToolACE): `[get_weather(city="Paris"), f2(x=1)]`.

Each element is a call of a plain name with keyword arguments whose values are Python literals;
the values become the arguments JSON. Anything else (positional arguments, expressions, names)
makes the whole output content: it is code or prose, not a call. Llama 4 may wrap the list in
`<|python_start|>` / `<|python_end|>`; text after the list is content.
"""

from __future__ import annotations

import ast
import json

from tokenmill.server.tools.parser_base import ToolCallStream, ToolParser
from tokenmill.server.tools.text_scan import finish_content, partial_marker_len, skip_ws
from tokenmill.server.tools.types import ExtractedToolCalls, ToolCall, ToolCallDelta

PY_START = "<|python_start|>"
PY_END = "<|python_end|>"
_OPENERS = {"(": ")", "[": "]", "{": "}"}


def parse_call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) for one element such as `f(a=1, b="x")`, or None if it is no call
    made only of literals."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):  # sets, bytes, complex numbers: no JSON for them
        return None


class ElementScanner:
    """Finds where one list element ends (a `,` or `]` outside brackets and strings), resuming
    where it stopped as the text grows."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._closers: list[str] = []
        self._quote: str | None = None
        self._escaped = False

    def scan(self, text: str) -> int | None:
        """Index of the `,` or `]` that ends the element (or of a stray closer), or None."""
        while self._pos < len(text):
            i, char = self._pos, text[self._pos]
            self._pos += 1
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = None
            elif char in "\"'":
                self._quote = char
            elif char in _OPENERS:
                self._closers.append(_OPENERS[char])
            elif char in ")]}":
                if not self._closers:
                    return i  # `]` ends the list; `)` or `}` here is malformed, parse_call says so
                if self._closers.pop() != char:
                    return i
            elif char == "," and not self._closers:
                return i
        return None


def _list_start(text: str) -> int | None:
    pos = skip_ws(text, 0)
    if text.startswith(PY_START, pos):
        pos = skip_ws(text, pos + len(PY_START))
    return pos if text.startswith("[", pos) else None


def _after_list(text: str, pos: int) -> list[str]:
    """The content after the list's `]`: an optional `<|python_end|>` right after it is no content."""
    end = skip_ws(text, pos)
    if text.startswith(PY_END, end):
        return [text[pos:end], text[end + len(PY_END) :]]
    return [text[pos:]]


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> ExtractedToolCalls:
        pos = _list_start(text)
        if pos is None:
            return ExtractedToolCalls(text or None)
        found: list[tuple[str, str]] = []
        pos += 1
        while True:
            end = ElementScanner(pos).scan(text)
            if end is None or text[end] not in ",]":
                return ExtractedToolCalls(text or None)
            source = text[pos:end]
            if source.strip() or text[end] == ",":  # `[f(), ]` ends with an empty element
                call = parse_call(source)
                if call is None:
                    return ExtractedToolCalls(text or None)
                found.append(call)
            pos = end + 1
            if text[end] == "]":
                break
        if not found:
            return ExtractedToolCalls(text or None)
        content = [text[: skip_ws(text, 0)], *_after_list(text, pos)]
        calls = [ToolCall(self.tool_call_id(), name, arguments) for name, arguments in found]
        return ExtractedToolCalls(finish_content(content, True), calls)

    def stream(self) -> PythonicStream:
        return PythonicStream(self.tool_call_id)


class PythonicStream(ToolCallStream):
    """Each call goes out whole once its element is complete: a call's arguments are only
    known to be literals when its closing parenthesis has arrived."""

    def __init__(self, new_id) -> None:
        super().__init__(new_id)
        self._pos = 0
        self._state = "start"  # -> "list" -> "after" -> "plain"
        self._scanner: ElementScanner | None = None

    def _advance(self, final: bool) -> None:
        text = self.text
        while True:
            if self._state == "start":
                lead = skip_ws(text, 0)
                rest = text[lead:]
                waiting = PY_START.startswith(rest) or rest.startswith(PY_START)
                if not final and waiting and skip_ws(text, lead + len(PY_START)) >= len(text):
                    return  # blanks, a growing <|python_start|>, or nothing after it yet
                start = _list_start(text)
                if start is None:
                    self._state, self._pos = "plain", 0
                    continue
                self._scanner, self._state = ElementScanner(start + 1), "list"
            elif self._state == "list":
                assert self._scanner is not None
                end = self._scanner.scan(text)
                if end is None:
                    if not final:
                        return
                    self._bad()
                    continue
                source = text[self._scanner.start : end]
                if text[end] not in ",]":
                    self._bad()
                    continue
                if source.strip() or text[end] == ",":
                    call = parse_call(source)
                    if call is None:
                        self._bad()
                        continue
                    if self._next_index == 0:  # blanks before the list count as content
                        self._emit_content(text[: skip_ws(text, 0)])
                    name, arguments = call
                    self._calls.append(ToolCallDelta(self._next_index, self._new_id(), name, arguments))
                    self._next_index += 1
                if text[end] == "]":
                    if self._next_index == 0:  # `[]` is no call
                        self._bad()
                        continue
                    self._pos, self._state = end + 1, "after"
                else:
                    self._scanner = ElementScanner(end + 1)
            elif self._state == "after":
                end = skip_ws(text, self._pos)
                if text.startswith(PY_END, end):
                    self._emit_content(text[self._pos : end])
                    self._pos = end + len(PY_END)
                elif not final and partial_marker_len(text[end:], PY_END) == len(text) - end:
                    return  # blanks, or what may still become <|python_end|>
                self._state = "plain"
            else:  # "plain"
                self._emit_content(text[self._pos :])
                self._pos = len(text)
                return

    def _bad(self) -> None:
        # Calls that went out stay; extract() would have made all of it content, no stream can.
        assert self._scanner is not None
        self._state = "plain"
        self._pos = 0 if self._next_index == 0 else self._scanner.start
