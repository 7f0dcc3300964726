"""The SSE events of a stream's plain text deltas, without building pydantic models per token.

Most events of a streamed completion carry one choice whose only content is a bit of text: no
logprobs, no finish reason, no usage. Building the response model and dumping it per token cost
~4 us of the API server's ~58 us a streamed token (benchmarks/api_stream_backlog.py). Here the
model is rendered once per stream, around sentinel values, and each event is that rendering with
the choice's index and text spliced in: byte for byte what `sse_event(model)` writes (the text
goes through pydantic-core's own JSON string encoding; tests/server/test_stream_events.py
compares them). Events with anything more still go through the models, with the same `created`.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel
from pydantic_core import to_json

from tokenmill.server.protocol import sse_event

_INDEX = 987654321  # sentinels: neither can occur in the rendering otherwise
_TEXT = "\ue000\ue001"


class TextDeltaEvents:
    """Events of one stream: `render(index, text)` for a plain text delta of choice `index`."""

    def __init__(
        self,
        empty_response: BaseModel,  # the stream's response model with no choices (id, model, created)
        text_choice: Callable[[int, str], BaseModel],  # the choice model of a plain text delta
    ) -> None:
        head, found, tail = sse_event(empty_response).partition('"choices":[]')
        if not found:
            raise ValueError(f"{type(empty_response).__name__} does not render an empty choices list")
        choice = text_choice(_INDEX, _TEXT).model_dump_json()
        before_index, _, rest = choice.partition(str(_INDEX))
        between, _, after_text = rest.partition(to_json(_TEXT).decode())
        self._parts = (head + '"choices":[' + before_index, between, after_text + "]" + tail)

    def render(self, index: int, text: str) -> str:
        start, between, end = self._parts
        return f"{start}{index}{between}{to_json(text).decode()}{end}"
