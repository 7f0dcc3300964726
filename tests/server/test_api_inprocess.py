"""The HTTP API in-process against a fake engine (no model, no subprocess): auth, limits, errors,
life-cycle statuses, SSE format, n, echo, logprobs, disconnects and draining."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.server.fake_engine import (
    MODEL,
    REPLY,
    FakeEngine,
    serve_over_fake_engine,
    wait_until,
)
from tokenmill.server.api_server import drain
from tokenmill.server.state import ServerState

Scenario = Callable[[httpx.AsyncClient, ServerState, FakeEngine], Awaitable[None]]


def run(scenario: Scenario, *, api_key: str | None = None, ready: bool = True, **state_kwargs) -> None:
    serve_over_fake_engine(
        scenario, timeout=10, model_names=[MODEL, "tiny-alias"], api_key=api_key, ready=ready, **state_kwargs
    )


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert text.endswith("\n\n"), text[-50:]
    events = text.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: "), event
    assert events[-1] == "data: [DONE]"
    return [e.removeprefix("data: ") for e in events]


def metric_value(state: ServerState, name: str, **labels: str) -> float:
    text = state.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith(f"tokenmill:{name}") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample tokenmill:{name} {labels}")


# --------------------------------------------------------------------------- raw ASGI, for disconnects


async def asgi_call(
    app,
    path: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
    body_parts: list[bytes] | None = None,
    on_body_chunk: Callable[[int], bool] | None = None,
    disconnect_after_s: float | None = None,
) -> tuple[int, bytes]:
    """Calls the app as uvicorn would. `on_body_chunk(n)` returning True makes the client leave after
    the n-th response chunk; `disconnect_after_s` makes it leave after that long."""
    parts = body_parts if body_parts is not None else [body]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]
    gone = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if on_body_chunk is not None and on_body_chunk(len(chunks)):
                gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"), *(headers or [])],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
    await app(scope, receive, send)
    return status, b"".join(chunks)


# --------------------------------------------------------------------------- authentication


def test_api_key_required_everywhere_but_health_and_metrics():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        good = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "Bearer s3cret2"}, {"Authorization": "s3cret"}):  # fmt: skip
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 401, headers
            error = r.json()["error"]
            assert (
                error["type"] == "invalid_request_error"
                and error["code"] == 401
                and "API key" in error["message"]
            )
            assert set(error) == {"message", "type", "param", "code"}
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        assert (
            await client.get("/v1/models", headers={"Authorization": "bearer  s3cret "})
        ).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        assert (
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=good)
        ).status_code == 200
        assert len(engine.core.added) == 1  # the refused request never reached the engine

        # Odd spellings of open paths, unknown routes and the docs all need the key (no 404 leak).
        app = client._transport.app  # type: ignore[attr-defined]
        for path in ("/health/", "//health", "/HEALTH", "/metrics/../v1/models", "/v1/nothing", "/docs",
                     "/openapi.json", "//v1/models", "/v1/models/", "/%2Fv1/models", "/v1/./models"):  # fmt: skip
            status, body = await asgi_call(app, path, method="GET")
            assert status == 401, (path, body)
        # An absolute request target or a Host header changes nothing: only the path counts.
        status, _ = await asgi_call(app, "/v1/models", method="GET", headers=[(b"host", b"localhost:8000")])
        assert status == 401

    run(scenario, api_key="s3cret")


# --------------------------------------------------------------------------- request errors


def test_body_limit_413_declared_and_streamed():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        big = json.dumps({"prompt": "x" * 3000, "max_tokens": 1}).encode()
        r = await client.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        app = client._transport.app  # type: ignore[attr-defined]
        # No content-length: the limit is enforced while reading.
        status, body = await asgi_call(app, "/v1/chat/completions", body_parts=[big[:1500], big[1500:]])
        assert status == 413, body
        assert (
            await client.post("/v1/completions", json={"prompt": "small", "max_tokens": 1})
        ).status_code == 200
        assert len(engine.core.added) == 1

    run(scenario, max_body_bytes=2048)


BAD_COMPLETIONS = [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x" * 200, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "n": 9}, 400, "n"),
    ({"prompt": "hi", "n": 1000}, 400, "n"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": [10**9]}, 400, "prompt"),
    ({"prompt": [5, 6, -1, 7]}, 400, "prompt"),  # checked over the whole list, not token by token
    ({"prompt": [5, 6, 10**9]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, -4]]}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(body, status, param):
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        for stream in (False, True) if "stream_options" not in body else (False,):
            r = await client.post("/v1/completions", json={**body, **({"stream": True} if stream else {})})
            assert r.status_code == status, r.text
            assert r.headers["content-type"] == "application/json"
            error = r.json()["error"]
            assert error["message"] and error["type"] and error["code"] == status
            if param is not None:
                assert error["param"] == param
        assert engine.core.added == []  # never reached the engine

    run(scenario, max_n=8)


def test_bad_chat_requests_and_malformed_bodies():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        cases = [
            (b"{not json", 400),
            (b"[]", 400),
            (b"", 400),
            (b'{"messages": []}', 400),
            (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400),
            (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400),
            (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', 400),
            (b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}', 404),
            (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
            (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}', 400),
            (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
            ('{"messages": [{"role": "user", "content": "\xff"}]}'.encode("latin-1"), 400),
        ]
        for body, status in cases:
            r = await client.post("/v1/chat/completions", content=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["code"] == status
        r = await client.post("/tokenize", json={"prompt": "hi", "model": "nope"})
        assert r.status_code == 404
        r = await client.post("/detokenize", json={"tokens": [100000]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await client.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()
        r = await client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert engine.core.added == []

    run(scenario)


# --------------------------------------------------------------------------- life cycle


def test_503_while_starting_draining_and_after_engine_death():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        async def all_unavailable() -> None:
            assert (await client.get("/health")).status_code == 503
            for path, body in (
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
                ("/tokenize", {"prompt": "hi"}),
            ):
                r = await client.post(path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["type"] == "service_unavailable"

        await all_unavailable()  # not ready yet
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
        state.ready = True
        assert (await client.get("/health")).status_code == 200
        state.draining = True
        await all_unavailable()
        state.draining = False
        engine.client.mark_dead("the engine process exited with code -9")
        await all_unavailable()
        assert "exited" in (await client.get("/health")).json()["reason"]
        assert engine.core.added == []

    run(scenario, ready=False)


def test_engine_death_fails_in_flight_requests_at_once():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50}))
        streamed = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True})
        )
        await wait_until(lambda: len(engine.core.added) == 2)
        engine.client.mark_dead("the engine process exited with code -9")
        r = await plain
        assert r.status_code == 503 and "exited" in r.json()["error"]["message"]
        events = sse_events((await streamed).text)
        assert json.loads(events[-2])["error"]["code"] == 503
        assert engine.num_unfinished == 0

    run(scenario)


def test_drain_aborts_what_outlives_the_timeout():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True
        body = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True}
        plain = asyncio.create_task(client.post("/v1/completions", json=body))
        streamed = asyncio.create_task(
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
            )
        )
        await wait_until(lambda: engine.num_unfinished == 2)
        await drain(state, timeout_s=0.05)
        assert (await client.get("/health")).status_code == 503
        assert (await client.post("/v1/completions", json=body)).status_code == 503
        r = await plain
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
        chunks = [json.loads(e) for e in sse_events((await streamed).text)[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert sorted(engine.core.aborted) == sorted(engine.core.added)
        assert engine.num_unfinished == 0 and not engine.output_processor.states
        assert metric_value(state, "request_success_total", finished_reason="abort") == 2

    run(scenario)


def test_drain_lets_requests_finish_within_the_timeout():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}))
        await wait_until(lambda: engine.num_unfinished == 1)
        draining = asyncio.create_task(drain(state, timeout_s=5))
        await asyncio.sleep(0.02)
        engine.core.paused = False
        await draining
        r = await plain
        assert r.json()["choices"][0]["finish_reason"] == "length" and engine.core.aborted == []

    run(scenario)


# --------------------------------------------------------------------------- disconnects


def test_client_disconnect_aborts_streaming_and_non_streaming():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        app = client._transport.app  # type: ignore[attr-defined]
        body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "n": 2}

        def leave_after_two(n: int) -> bool:
            if n == 2:
                engine.core.paused = True  # freeze the engine: the abort must come from the disconnect
                return True
            return False

        status, _ = await asgi_call(app, "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                    on_body_chunk=leave_after_two)  # fmt: skip
        assert status == 200
        assert sorted(engine.core.aborted) == sorted(engine.core.added) and len(engine.core.added) == 2
        assert engine.num_unfinished == 0 and not engine.output_processor.states

        engine.core.paused = True
        status, _ = await asgi_call(
            app, "/v1/completions", json.dumps(body).encode(), disconnect_after_s=0.05
        )
        assert status == 499
        assert len(engine.core.added) == 4 and sorted(engine.core.aborted) == sorted(engine.core.added)
        assert engine.num_unfinished == 0
        assert metric_value(state, "request_success_total", finished_reason="abort") == 4
        engine.core.paused = False
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.json()["choices"][0]["finish_reason"] == "length"

    run(scenario)


def test_request_timeout_aborts_with_an_error_event():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True
        body = {"prompt": "hi", "max_tokens": 50, "request_timeout": 0.05}
        r = await client.post("/v1/completions", json=body)
        assert r.json()["choices"][0]["finish_reason"] == "abort"
        events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        assert json.loads(events[-3])["error"]["type"] == "timeout_error"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert sorted(engine.core.aborted) == sorted(engine.core.added)

    run(scenario)


# --------------------------------------------------------------------------- responses


def test_models_tokenize_detokenize_version_metrics():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL, "tiny-alias"]
        assert models["data"][0]["root"] == "/models/tiny" and models["data"][0]["max_model_len"] == 128
        tokens = (await client.post("/tokenize", json={"prompt": "héllo"})).json()
        assert tokens["count"] == len(tokens["tokens"]) == 6  # 5 characters, é is 2 bytes
        assert (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json() == {
            "prompt": "héllo"
        }
        chat_tokens = (
            await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
        ).json()
        assert engine.tokenizer.decode(chat_tokens["tokens"]).endswith("<|im_start|>assistant\n")
        assert (await client.get("/version")).json()["version"]
        r = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "model": "tiny-alias"}
        )
        assert r.json()["model"] == "tiny-alias"
        text = (await client.get("/metrics")).text
        for name in ("request_success_total", "time_to_first_token_seconds_count", "generation_tokens_total"):
            assert re.search(rf"^tokenmill:{name}\{{", text, re.M), name
        assert metric_value(state, "generation_tokens_total") == 3

    run(scenario)


def test_completion_non_streaming_and_streaming_agree():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = {"model": MODEL, "prompt": "Say", "max_tokens": 100, "temperature": 0}
        full = Completion.model_validate((await client.post("/v1/completions", json=body)).json())
        assert full.choices[0].text == REPLY and full.choices[0].finish_reason == "stop"
        reply_tokens = len(REPLY.encode())
        assert full.usage.completion_tokens == reply_tokens + 1  # + EOS
        assert full.usage.prompt_tokens == 3
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=stream_body)
        assert r.headers["content-type"].startswith("text/event-stream")
        # openai's Completion type (the client builds stream chunks without validation) insists on a
        # finish_reason, so only the last chunk with choices is validated against it.
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert all(c["id"] == chunks[0]["id"] and c["model"] == MODEL for c in chunks)
        assert all(c["object"] == "text_completion" and isinstance(c["created"], int) for c in chunks)
        assert len({c["created"] for c in chunks}) == 1  # one timestamp a stream, as OpenAI's
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY
        last = Completion.model_validate(chunks[-2])
        assert last.choices[0].finish_reason == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)
        assert all(c["usage"] is None for c in chunks[:-1])
        # Without include_usage there is no usage chunk.
        plain = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        assert json.loads(plain[-2])["choices"][0]["finish_reason"] == "stop"

    run(scenario)


def test_chat_streaming_format():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_completion_tokens": 12}  # fmt: skip
        full = ChatCompletion.model_validate((await client.post("/v1/chat/completions", json=body)).json())
        assert full.choices[0].message.role == "assistant"
        assert full.choices[0].message.content == REPLY.encode()[:12].decode()
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
        r = await client.post(
            "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        chunks = [ChatCompletionChunk.model_validate_json(e) for e in sse_events(r.text)[:-1]]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.total_tokens == full.usage.total_tokens
        assert len({c.created for c in chunks}) == 1 and len({c.id for c in chunks}) == 1

    run(scenario)


def test_n_and_multiple_prompts_indexes():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = {"prompt": [[111, 110, 101], [72, 105]], "n": 2, "max_tokens": 4, "seed": 3}
        out = Completion.model_validate((await client.post("/v1/completions", json=body)).json())
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert out.usage.prompt_tokens == 3 + 2 and out.usage.completion_tokens == 16
        assert sorted(r.sampling_params.seed for r in engine.core.requests) == [3, 3, 4, 4]
        r = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
        assert finished == [0, 1, 2, 3]
        chat = {"messages": [{"role": "user", "content": "x"}], "n": 3, "max_tokens": 2}
        out = (await client.post("/v1/chat/completions", json=chat)).json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        r = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        roles = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role"))
        assert roles == [0, 1, 2]

    run(scenario)


def test_echo_and_logprobs_shapes():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = {"prompt": "Hey", "max_tokens": 5, "logprobs": 2}
        out = Completion.model_validate((await client.post("/v1/completions", json=body)).json())
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
        assert all(len(top) == 3 for top in lp.top_logprobs)  # the sampled token + 2 alternatives
        assert lp.text_offset == sorted(lp.text_offset) and all(v == -0.25 for v in lp.token_logprobs)

        # The first echoed token has no logprob: null, as OpenAI's legacy API answers (the SDK's
        # type says float, but the client does not validate responses).
        echo = (await client.post("/v1/completions", json={**body, "echo": True})).json()["choices"][0]
        assert echo["text"] == "Hey" + out.choices[0].text
        lp = echo["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3 + 5
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:3] == ["H", "e", "y"] and lp["token_logprobs"][1] == -0.25

        stream_echo = await client.post(
            "/v1/completions", json={"prompt": "Hey", "max_tokens": 2, "echo": True, "stream": True}
        )
        first = json.loads(sse_events(stream_echo.text)[0])
        assert first["choices"][0]["text"] == "Hey"
        r = await client.post("/v1/completions", json={**body, "echo": True, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"

        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
        tokens = [
            t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]
        ]
        assert tokens == out.choices[0].logprobs.tokens

        chat = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
        }
        out = ChatCompletion.model_validate((await client.post("/v1/chat/completions", json=chat)).json())
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens == 4
        assert all(len(c.top_logprobs) == 2 and c.logprob == -0.25 for c in content)
        assert content[0].top_logprobs[0].token == content[0].token  # the sampled token ranks first here
        no_top = (await client.post("/v1/chat/completions", json={**chat, "top_logprobs": 0})).json()
        assert all(c["top_logprobs"] == [] for c in no_top["choices"][0]["logprobs"]["content"])
        streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
        entries = [
            e
            for c in chunks
            if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert [e["token"] for e in entries] == [c.token for c in content]

    run(scenario)


def test_stop_strings_cached_tokens_and_ignore_eos():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        out = (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 60, "stop": ["fox"]})
        ).json()
        assert (
            out["choices"][0]["text"] == " The quick brown " and out["choices"][0]["finish_reason"] == "stop"
        )
        assert out["choices"][0]["stop_reason"] == "fox"
        r = await client.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 60, "stop": ["fox"], "stream": True}
        )
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == " The quick brown "
        await wait_until(lambda: not engine.core.running)  # the stop string aborted them in the engine
        long_prompt = "z" * 40
        first = (await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})).json()
        second = (await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        out = (
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 90, "ignore_eos": True})
        ).json()
        assert out["usage"]["completion_tokens"] == 90 and out["choices"][0]["finish_reason"] == "length"

    run(scenario)


# --------------------------------------------------------------------------- fault isolation


def test_a_failing_request_ends_alone_with_an_error():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        processor = engine.output_processor
        real = processor.process_outputs

        def flaky(outputs, now=None):
            state_ = processor.states.get(outputs[0].request_id)
            if state_ is not None and state_.prompt == "poison" and state_.token_ids:
                raise RuntimeError("detokenizer exploded")
            return real(outputs, now)

        processor.process_outputs = flaky  # type: ignore[method-assign]

        def broken_metrics(*_args) -> None:
            raise ValueError("metrics bug")

        engine.on_step_stats = broken_metrics  # a metrics bug is logged, never fatal
        healthy = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 8})
        )
        bad = await client.post("/v1/completions", json={"prompt": "poison", "max_tokens": 8})
        assert bad.status_code == 500 and "detokenizer exploded" in bad.json()["error"]["message"]
        streamed = await client.post(
            "/v1/completions", json={"prompt": "poison", "max_tokens": 8, "stream": True}
        )
        events = sse_events(streamed.text)
        assert "detokenizer exploded" in json.loads(events[-3])["error"]["message"]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "error"
        assert (await healthy).json()["choices"][0]["finish_reason"] == "length"
        assert not engine.dead and (await client.get("/health")).status_code == 200
        await wait_until(lambda: not engine.core.running)  # the failed ones were aborted in the engine
        assert len(engine.core.aborted) == 2
        assert metric_value(state, "request_success_total", finished_reason="error") == 2

    run(scenario)


def test_huge_prompt_is_tokenized_off_the_event_loop():
    """Tokenizing (or decoding) a body near --max-body-bytes takes seconds: it must run in a worker
    thread, not on the event loop every stream shares; small ones stay on the loop."""

    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        tokenizer = engine.tokenizer
        [y_id] = tokenizer.encode("y", add_special_tokens=False)
        hi_ids = tokenizer.encode("hi", add_special_tokens=False)
        on_loop: list[tuple[str, bool]] = []

        def spy(name: str) -> None:
            real = getattr(tokenizer, name)

            def wrapper(*args, **kwargs):
                on_loop.append((name, threading.current_thread() is threading.main_thread()))
                return real(*args, **kwargs)

            setattr(tokenizer, name, wrapper)

        for name in ("encode", "apply_chat_template", "decode"):
            spy(name)
        huge = "y" * 100_000
        r = await client.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert engine.core.added == []
        r = await client.post("/tokenize", json={"prompt": huge})
        assert r.status_code == 200 and r.json()["count"] == 100_000
        r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": huge}]})
        assert r.status_code == 200 and r.json()["count"] > 100_000
        r = await client.post("/detokenize", json={"tokens": [y_id] * 100_000})
        assert r.status_code == 200 and r.json()["prompt"] == huge
        assert on_loop and not any(loop for _, loop in on_loop), on_loop
        assert {name for name, _ in on_loop} == {"encode", "apply_chat_template", "decode"}

        on_loop.clear()  # small bodies are not worth a thread hop
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 200
        assert (await client.post("/detokenize", json={"tokens": hi_ids})).json()["prompt"] == "hi"
        assert (
            await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        ).status_code == 200
        assert on_loop and all(loop for _, loop in on_loop), on_loop

    run(scenario)


def test_debug_invariants_endpoint_is_opt_in_and_reports_the_engine_check():
    async def absent(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        assert (await client.get("/debug/invariants")).status_code == 404

    async def present(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        ok = await client.get("/debug/invariants")
        assert ok.status_code == 200 and ok.json()["ok"] is True, ok.text
        assert "num_running" in ok.json()["stats"]
        engine.core.invariant_error = "AssertionError: block 3: ref_count 1 but 0 requests hold it"
        broken = await client.get("/debug/invariants")
        assert broken.status_code == 500
        assert "block 3: ref_count 1" in broken.json()["error"]["message"]

    async def behind_the_key(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        assert (await client.get("/debug/invariants")).status_code == 401

    run(absent)
    run(present, enable_debug_endpoints=True)
    run(behind_the_key, api_key="sekrit", enable_debug_endpoints=True)
