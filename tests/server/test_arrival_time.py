"""The engine request's arrival_time is when the HTTP request reached the route, not when it was
tokenized: its TTFT, queue time and the slo policy's deadline and shedding count from it, so time
the API server spends parsing and tokenizing under load is charged against the request's target."""

from __future__ import annotations

import time

import pytest

import tokenmill.server.serving_chat as serving_chat
import tokenmill.server.serving_completion as serving_completion
from tests.server.fake_engine import MODEL, serve_over_fake_engine

SLOW_S = 0.2  # what tokenizing takes here: the arrival must come before it


@pytest.mark.parametrize(
    ("module", "name", "path", "body"),
    [
        (serving_completion, "prepare_prompts", "/v1/completions", {"prompt": "abc"}),
        (serving_chat, "render_chat_prompt", "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_arrival_is_the_http_arrival_not_the_end_of_tokenizing(monkeypatch, module, name, path, body, stream):
    tokenize = getattr(module, name)

    def slow_tokenize(*args, **kwargs):
        time.sleep(SLOW_S)  # blocks the event loop, as a long prompt's tokenizing does
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(module, name, slow_tokenize)

    async def scenario(client, state, engine):
        sent = time.monotonic()
        r = await client.post(path, json={"model": MODEL, "max_tokens": 3, "stream": stream, **body})
        assert r.status_code == 200
        tokenized_by = sent + SLOW_S
        (request,) = engine.core.requests
        assert sent <= request.arrival_time < tokenized_by, (request.arrival_time - sent)

    serve_over_fake_engine(scenario)
