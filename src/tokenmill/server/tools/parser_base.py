"""What every `--tool-call-parser` provides: whole-output extraction and a streaming state.

A parser is stateless and shared by all requests; `stream()` gives one request's state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from tokenmill.server.tools.ids import openai_tool_call_id
from tokenmill.server.tools.text_scan import ContentEmitter
from tokenmill.server.tools.types import ExtractedToolCalls, StreamDelta, ToolCallDelta, merge_call_deltas


class ToolCallStream(ABC):
    """One request's streaming state: `feed()` each new piece of detokenized text, then `finish()`.

    Content before a call goes out at once, except text that may still become a marker and
    trailing whitespace (see ContentEmitter). A call's first delta carries its id and name,
    later ones argument fragments. Nothing that went out is ever taken back, so a call that
    turns out malformed after its name went out stays cut short (the non-streaming result
    would have made the whole output content; no stream can).
    """

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.text = ""
        self._new_id = new_id
        self._content = ContentEmitter()
        self._calls: list[ToolCallDelta] = []
        self.num_calls = 0  # calls whose first delta went out
        self._next_index = 0  # the index the next call to start will get
        self._finished = False

    @property
    def tools_called(self) -> bool:
        """A call has gone out (finish_reason "tool_calls"); final once finish() has run."""
        return self.num_calls > 0

    def feed(self, delta_text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self.text += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """Decides what was held back at the end of the output."""
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            self._content.finish(has_calls=self.num_calls > 0 or any(d.name for d in self._calls))
        return self._take()

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Consumes as much of self.text as can be decided, through _emit_content / self._calls."""

    def _emit_content(self, text: str) -> None:
        self._content.add(text)

    def _take(self) -> StreamDelta:
        self.num_calls += sum(1 for d in self._calls if d.name is not None)
        out = StreamDelta(content=self._content.take(), tool_calls=merge_call_deltas(self._calls))
        self._calls.clear()
        return out


class ToolParser(ABC):
    name: ClassVar[str]
    # The markers are special tokens that detokenizing with skip_special_tokens drops: the server
    # must keep them (skip_special_tokens=False) for this parser to see any call.
    needs_special_tokens: ClassVar[bool] = False

    def tool_call_id(self) -> str:
        return openai_tool_call_id()

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Splits a whole output; with no valid call, all of it is content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one output."""
