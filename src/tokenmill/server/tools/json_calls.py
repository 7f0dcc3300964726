"""Following JSON tool calls as their text grows: the pieces every JSON-based parser shares.

Arguments stream as the model's own text: every character after an argument object's `{` and
up to its matching `}` belongs to that object, so it can go out as soon as it arrives and is
never taken back. `json.JSONDecoder.raw_decode` (C speed) tells when a value is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tokenmill.server.tools.text_scan import skip_ws
from tokenmill.server.tools.types import ToolCallDelta

_DECODER = json.JSONDecoder()

MORE = None  # a follower's step needs more text
BAD = -1  # the text cannot be what the follower expects


def decode_value(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` and the index after it; None if it is not complete (or
    not JSON)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON object text: objects as they are, a JSON string holding an
    object (some models double-encode), or nothing (no arguments); anything else is no call."""
    if value is None:
        value = {}
    elif isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    value = next((obj[k] for k in argument_keys if k in obj), None)
    arguments = arguments_json(value)
    return None if arguments is None else (name, arguments)


class ArgumentsFollower:
    """Streams one arguments object, from its `{`, as raw text fragments."""

    def __init__(self, start: int, index: int, out: list[ToolCallDelta]) -> None:
        self.start = start
        self.index = index
        self._out = out
        self._sent = start  # text before this index has gone out

    def step(self, text: str, final: bool) -> int | None:
        """Index after the object once complete, MORE, or BAD."""
        done = decode_value(text, self.start)
        end = done[1] if done is not None else len(text)
        if done is not None and not isinstance(done[0], dict):
            return BAD
        if end > self._sent:
            self._out.append(ToolCallDelta(self.index, arguments=text[self._sent : end]))
            self._sent = end
        if done is not None:
            return end
        return BAD if final else MORE


def _header_pattern(argument_keys: tuple[str, ...]) -> re.Pattern[str]:
    keys = "|".join(re.escape(k) for k in argument_keys)
    return re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:' + keys + r')"\s*:\s*')


class CallFollower:
    """Streams one `{"name": ..., "<arguments key>": {...}}` object starting at `start`.

    With the usual key order the name goes out (with a fresh id) once `"name": "...", "arguments":`
    has arrived, then the arguments stream raw. Any other shape (arguments first, extra keys,
    arguments as a JSON string) is held until the object is complete and goes out whole.
    """

    def __init__(
        self,
        start: int,
        index: int,
        argument_keys: tuple[str, ...],
        new_id: Callable[[], str],
        out: list[ToolCallDelta],
    ) -> None:
        self.start = start
        self.index = index
        self._keys = argument_keys
        self._header = _header_pattern(argument_keys)
        self._new_id = new_id
        self._out = out
        self.named = False  # the first delta (id, name) has gone out: this call can't be taken back
        self._value_from: int | None = None  # where the arguments value starts (after blanks)
        self._arguments: ArgumentsFollower | None = None

    def step(self, text: str, final: bool) -> int | None:
        """Index after the call object once complete and valid, MORE, or BAD."""
        done = decode_value(text, self.start)
        if done is not None:
            return self._complete(text, done[0], done[1])
        if final:
            return BAD
        if not self.named:
            match = self._header.match(text, self.start)
            if match is None:
                return MORE
            try:
                name = json.loads(match.group(1))
            except json.JSONDecodeError:
                return BAD
            if not name:
                return BAD
            self._out.append(ToolCallDelta(self.index, id=self._new_id(), name=name, arguments=""))
            self.named = True
            self._value_from = match.end()
        if self._arguments is None:
            assert self._value_from is not None
            first = skip_ws(text, self._value_from)
            if first < len(text) and text[first] == "{":
                self._arguments = ArgumentsFollower(first, self.index, self._out)
        if self._arguments is not None and self._arguments.step(text, final=False) == BAD:
            return BAD
        return MORE

    def _complete(self, text: str, obj: Any, end: int) -> int:
        call = call_from_object(obj, self._keys)
        if call is None:
            return BAD
        name, arguments = call
        if not self.named:
            self._out.append(ToolCallDelta(self.index, id=self._new_id(), name=name, arguments=arguments))
            self.named = True
        elif self._arguments is not None:
            if self._arguments.step(text, final=True) == BAD:
                return BAD
        else:  # named, but the arguments were no object to stream (a string, null): send them whole
            self._out.append(ToolCallDelta(self.index, arguments=arguments))
        return end


class CallArrayFollower:
    """Streams a JSON array of call objects (`[{...}, {...}]`) starting at its `[`."""

    def __init__(
        self,
        start: int,
        first_index: int,
        argument_keys: tuple[str, ...],
        new_id: Callable[[], str],
        out: list[ToolCallDelta],
    ) -> None:
        self._pos = start + 1
        self._next_index = first_index
        self._keys = argument_keys
        self._new_id = new_id
        self._out = out
        self._call: CallFollower | None = None
        self._expect = "call_or_end"  # then "comma_or_end" after each call, "call" after a comma
        self.calls_done = 0

    @property
    def next_index(self) -> int:
        return self._next_index

    @property
    def partial_call(self) -> bool:
        """A call has started going out but is not complete: it cannot be taken back."""
        return self._call is not None and self._call.named

    def step(self, text: str, final: bool) -> int | None:
        """Index after the closing `]` once complete, MORE, or BAD."""
        while True:
            if self._call is not None:
                end = self._call.step(text, final)
                if end is None or end == BAD:
                    return end
                self._call = None
                self.calls_done += 1
                self._pos = end
                self._expect = "comma_or_end"
            pos = skip_ws(text, self._pos)
            if pos == len(text):
                return BAD if final else MORE
            char = text[pos]
            if char == "{" and self._expect in ("call_or_end", "call"):
                self._call = CallFollower(pos, self._next_index, self._keys, self._new_id, self._out)
                self._next_index += 1
            elif char == "," and self._expect == "comma_or_end":
                self._pos = pos + 1
                self._expect = "call"
            elif char == "]" and self._expect in ("call_or_end", "comma_or_end"):
                return pos + 1
            else:
                return BAD
