"""TextDeltaEvents writes exactly what sse_event(model) writes for a plain text delta."""

from __future__ import annotations

import pytest

from tokenmill.server.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    sse_event,
)
from tokenmill.server.stream_events import TextDeltaEvents

TEXTS = [
    "", " hello", 'quote " and backslash \\ and slash /', "line\nbreak\r\ttab\b\f", "\x00\x01\x1f\x7f",
    "é 中文 🙂 \u2028\u2029", "\ue000\ue001 (the renderer's own sentinel)", "987654321", '"choices":[]',
    "".join(chr(c) for c in range(0, 300)),
]  # fmt: skip


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_plain_text_deltas_render_byte_for_byte_as_the_models_do(kind: str) -> None:
    request_id, model, created = 'cmpl-"odd\\id', "org/model \u00e9", 1_700_000_000
    if kind == "completion":
        events = TextDeltaEvents(
            CompletionStreamResponse(id=request_id, model=model, created=created, choices=[]),
            lambda index, text: CompletionResponseChoice(index=index, text=text),
        )

        def expected(index: int, text: str) -> str:
            choice = CompletionResponseChoice(index=index, text=text)
            return sse_event(CompletionStreamResponse(id=request_id, model=model, created=created, choices=[choice]))
    else:
        events = TextDeltaEvents(
            ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[]),
            lambda index, text: ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text)),
        )

        def expected(index: int, text: str) -> str:
            choice = ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text))
            return sse_event(ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[choice]))

    for index in (0, 1, 7, 123):
        for text in TEXTS:
            assert events.render(index, text) == expected(index, text), (index, text)


def test_a_response_without_an_empty_choices_rendering_is_refused() -> None:
    with pytest.raises(ValueError, match="does not render an empty choices list"):
        TextDeltaEvents(
            CompletionResponseChoice(index=0, text="x"), lambda index, text: CompletionResponseChoice(index=index, text=text)
        )
