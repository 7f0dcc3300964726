"""The disaggregation proxy against mock upstreams: the producer gets a one-token, non-streamed
copy of each completion request, the consumer the request unchanged, and the consumer's answer
(streamed or not) reaches the client; a failing producer only costs the prefill."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from tokenmill.server.disagg_proxy import make_app, prefill_body

PRODUCER, CONSUMER = "http://producer", "http://consumer"


class Upstreams:
    def __init__(self, producer_status: int = 200) -> None:
        self.seen: list[tuple[str, str, dict]] = []
        self.producer_status = producer_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        host = request.url.host
        self.seen.append((host, request.url.path, body))
        if host == "producer":
            return httpx.Response(self.producer_status, json={"choices": [{"text": "x"}]})
        if body.get("stream"):
            return httpx.Response(
                200, content=b'data: {"a": 1}\n\ndata: [DONE]\n\n', headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"choices": [{"text": "answer"}], "usage": {"cached": 32}})


def _client(upstreams: Upstreams) -> TestClient:
    return TestClient(make_app(PRODUCER, CONSUMER, transport=httpx.MockTransport(upstreams)))


def test_prefill_then_decode_non_streamed() -> None:
    upstreams = Upstreams()
    with _client(upstreams) as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 20, "n": 2, "stream_options": {"include_usage": True}}
        response = client.post("/v1/completions", json=body, headers={"authorization": "Bearer k"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "answer"
    (p_host, p_path, p_body), (c_host, c_path, c_body) = upstreams.seen
    assert (p_host, p_path, c_host, c_path) == ("producer", "/v1/completions", "consumer", "/v1/completions")
    assert p_body == {"model": "m", "prompt": "hello", "max_tokens": 1, "n": 1, "stream": False}
    assert c_body == body


def test_streamed_answer_is_relayed_and_chat_limits_are_cut_to_one_token() -> None:
    upstreams = Upstreams()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 9}
    with _client(upstreams) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.text == 'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert upstreams.seen[0][2]["max_completion_tokens"] == 1 and upstreams.seen[0][2]["stream"] is False
    assert upstreams.seen[1][2] == body


def test_a_failing_producer_only_costs_the_prefill() -> None:
    upstreams = Upstreams(producer_status=503)
    with _client(upstreams) as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 3})
        assert client.app.state.prefill_failures == 1
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "answer"


def test_other_routes_go_to_the_consumer() -> None:
    upstreams = Upstreams()
    with _client(upstreams) as client:
        assert client.get("/v1/models").status_code == 200
    assert upstreams.seen == [("consumer", "/v1/models", {})]


def test_prefill_body_drops_what_a_one_token_request_cannot_take() -> None:
    body = prefill_body({"prompt": "p", "min_tokens": 5, "best_of": 3, "stream": True, "max_tokens": 50})
    assert body == {"prompt": "p", "max_tokens": 1, "stream": False, "n": 1}
