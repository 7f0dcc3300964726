"""Admission control, deadlines and input limits, on the real HTTP stack over the scripted FakeEngine
(uvicorn on loopback where the transport matters: header size, stalled clients)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.reliability.fake_server import FakeServer, assert_openai_error, run, sse_json
from tests.server.fake_engine import wait_until
from tokenmill.server.admission import AdmissionControl
from tokenmill.server.api_server import _EventStreamResponse
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving_completion import create_completion

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


# --------------------------------------------------------------------------- admission control


def test_waiting_sequence_bound_gives_429_with_retry_after_and_nothing_reaches_the_engine():
    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.paused = True  # nothing starts: admitted requests keep waiting
        body = {"prompt": "hi", "max_tokens": 3}
        first = asyncio.create_task(fs.client.post(COMPLETIONS, json=body))
        second = asyncio.create_task(fs.client.post(CHAT, json=chat_body(max_tokens=3, stream=True)))
        await wait_until(lambda: fs.state.admission.num_waiting_seqs == 2)
        for path, request in (
            (COMPLETIONS, body),
            (CHAT, chat_body(stream=True)),
            (COMPLETIONS, {**body, "n": 2}),
        ):
            r = await fs.client.post(path, json=request)
            error = assert_openai_error(r, 429)
            assert r.headers["retry-after"] == "1" and error["type"] == "rate_limit_exceeded"
            assert "overloaded" in error["message"]
        # More sequences than may ever wait: retrying cannot help, so 400 naming n.
        assert_openai_error(await fs.client.post(COMPLETIONS, json={**body, "n": 3}), 400, "n")
        assert len(fs.engine.core.added) == 2  # the refused requests never reached the engine

        fs.engine.core.paused = False
        assert (await first).json()["choices"][0]["finish_reason"] == "length"
        assert sse_json((await second).text)[-1]["choices"][0]["finish_reason"] == "length"
        assert (fs.state.admission.num_waiting_seqs, fs.state.admission.num_waiting_tokens) == (0, 0)
        assert (await fs.client.post(COMPLETIONS, json={**body, "n": 2})).status_code == 200

    run(scenario, admission=AdmissionControl(max_num_waiting_seqs=2))


def test_waiting_token_bound_counts_prompt_tokens_until_the_first_token():
    async def scenario(fs: FakeServer) -> None:
        prompt = [7] * 30  # 30 prompt tokens
        fs.engine.core.paused = True
        waiting = asyncio.create_task(fs.client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True}))  # fmt: skip
        await wait_until(lambda: fs.state.admission.num_waiting_tokens == 30)
        r = await fs.client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2})
        assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "1"
        # Small enough to fit beside the waiting one.
        fs_small = asyncio.create_task(
            fs.client.post(COMPLETIONS, json={"prompt": [7] * 10, "max_tokens": 2})
        )
        await wait_until(lambda: fs.state.admission.num_waiting_tokens == 40)
        # Alone beyond the bound: 400 naming the prompt.
        assert_openai_error(await fs.client.post(COMPLETIONS, json={"prompt": [7] * 41}), 400, "prompt")
        # Once the first token is out, a request no longer waits, though it keeps running.
        fs.engine.core.paused = False
        assert (await fs_small).status_code == 200
        await wait_until(lambda: fs.state.admission.num_waiting_tokens == 0)
        assert not waiting.done()
        r = await fs.client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200
        assert (await waiting).json()["usage"]["completion_tokens"] == 40

    run(scenario, step_s=0.01, admission=AdmissionControl(max_num_waiting_tokens=40))


def test_admission_is_released_however_a_request_ends():
    async def scenario(fs: FakeServer) -> None:
        admission = fs.state.admission
        fs.engine.core.paused = True
        # Client gone before the streaming response started, while streaming, and non-streaming.
        for stream, leave_after in ((True, 0.0), (True, 0.05), (False, 0.05)):
            request = fs.client.post(COMPLETIONS, json={"prompt": "hi", "n": 2, "stream": stream})
            task = asyncio.create_task(request)
            await asyncio.sleep(leave_after)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: admission.num_waiting_seqs == 0 and fs.engine.num_unfinished == 0)
        # A streaming response cancelled before it sent its first event (the client left at once).
        events = await create_completion(fs.state, CompletionRequest(prompt="hi", stream=True))
        assert admission.num_waiting_seqs == 1

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await asyncio.sleep(10)  # still sending the headers when the disconnect cancels it

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await _EventStreamResponse(events)(scope, receive, send)
        assert admission.num_waiting_seqs == 0 and fs.engine.num_unfinished == 0
        # The engine dies with requests waiting.
        pending = asyncio.create_task(fs.client.post(COMPLETIONS, json={"prompt": "hi"}))
        await wait_until(lambda: admission.num_waiting_seqs == 1)
        fs.engine.client.mark_dead("the engine process exited with code -9")
        assert_openai_error(await pending, 503)
        assert (admission.num_waiting_seqs, admission.num_waiting_tokens) == (0, 0)

    run(scenario, admission=AdmissionControl(max_num_waiting_seqs=4))


def test_a_request_that_could_never_fit_in_the_kv_pool_is_refused_at_admission():
    """The pool (8 blocks x 4 = 32 tokens) is smaller than the context (128): a request needing more
    KV than the whole pool is a 400 naming what to lower, never admitted to wait for room."""

    async def scenario(fs: FakeServer) -> None:
        capacity = fs.engine.info.num_kv_blocks * fs.engine.info.block_size
        assert capacity == 32 < fs.engine.info.max_model_len
        too_big = [
            (COMPLETIONS, {"prompt": [7] * 10, "max_tokens": 23}, "max_tokens"),  # 33 tokens
            (COMPLETIONS, {"prompt": [7] * 40, "max_tokens": 1}, "max_tokens"),  # the prompt alone
            (CHAT, chat_body(messages=[{"role": "user", "content": "x" * 40}]), "prompt"),  # no max_tokens
            (CHAT, chat_body(max_tokens=40), "max_tokens"),
        ]
        for path, body, param in too_big:
            for stream in (False, True):
                r = await fs.client.post(path, json={**body, "stream": stream})
                error = assert_openai_error(r, 400, param)
                assert "KV cache" in error["message"] and str(capacity) in error["message"], error
        assert fs.engine.core.added == []
        assert (fs.state.admission.num_waiting_seqs, fs.state.admission.num_waiting_tokens) == (0, 0)

        # Exactly the pool fits; a chat without max_tokens is capped at what the pool can hold.
        r = await fs.client.post(COMPLETIONS, json={"prompt": [7] * 10, "max_tokens": 22, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 22, r.text
        r = await fs.client.post(CHAT, json=chat_body(ignore_eos=True))
        usage = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == capacity, usage

    run(scenario, num_kv_blocks=8)


# --------------------------------------------------------------------------- deadlines


def test_request_timeout_returns_what_was_generated_with_finish_reason_abort():
    async def scenario(fs: FakeServer) -> None:
        body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True}
        started = time.monotonic()
        r = await fs.client.post(COMPLETIONS, json=body)  # the server's --request-timeout: 0.6 s
        assert 0.55 < time.monotonic() - started < 2
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "abort"
        assert choice["text"] and 0 < r.json()["usage"]["completion_tokens"] < 120

        # The request's own request_timeout may shorten the server's, never lengthen it.
        started = time.monotonic()
        r = await fs.client.post(CHAT, json=chat_body(max_tokens=80, ignore_eos=True, request_timeout=0.05))
        assert r.json()["choices"][0]["finish_reason"] == "abort" and time.monotonic() - started < 0.45
        started = time.monotonic()
        r = await fs.client.post(CHAT, json=chat_body(max_tokens=80, ignore_eos=True, request_timeout=60))
        assert r.json()["choices"][0]["finish_reason"] == "abort" and time.monotonic() - started < 2

        # Streaming: an error event, then the final chunk with finish_reason abort, then [DONE].
        r = await fs.client.post(CHAT, json=chat_body(max_tokens=80, ignore_eos=True, stream=True, n=2))
        chunks = sse_json(r.text)
        errors = [c["error"] for c in chunks if "error" in c]
        assert len(errors) == 2 and all(e["code"] == 408 and e["type"] == "timeout_error" for e in errors)
        finals = [c["choices"][0] for c in chunks if "choices" in c and c["choices"][0]["finish_reason"]]
        assert sorted(f["index"] for f in finals) == [0, 1] and {f["finish_reason"] for f in finals} == {
            "abort"
        }
        for i, chunk in enumerate(chunks):  # each error event comes just before its final chunk
            if "choices" in chunk and chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                assert "error" in chunks[i - 1]
        # Every sequence was aborted in the engine (which frees its KV blocks) and nothing is left.
        assert sorted(fs.engine.core.aborted) == sorted(fs.engine.core.added)
        assert fs.engine.num_unfinished == 0 and not fs.engine.core.running

    # 0.6 s, not 0.3: the 0.05 s request_timeout's reply (~0.055 s) once took 0.29 s in a fresh-clone
    # CI run (cause not traced), past the old 0.25 s bound; it must still end well before the server's.
    run(scenario, step_s=0.01, request_timeout=0.6)


def test_max_queue_time_aborts_requests_that_never_start():
    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.paused = True  # the engine never schedules them
        started = time.monotonic()
        r = await fs.client.post(COMPLETIONS, json={"prompt": "hi", "n": 2})
        assert time.monotonic() - started < 1
        error = assert_openai_error(r, 503)
        assert error["type"] == "service_unavailable" and "queue" in error["message"]
        assert r.headers["retry-after"] == "1"

        r = await fs.client.post(CHAT, json=chat_body(stream=True))
        assert r.status_code == 200  # the stream had started (role chunk) before the limit passed
        chunks = sse_json(r.text)
        assert chunks[-2]["error"]["code"] == 503 and "queue" in chunks[-2]["error"]["message"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert (
            sorted(fs.engine.core.aborted) == sorted(fs.engine.core.added) and len(fs.engine.core.added) == 3
        )
        assert fs.state.admission.num_waiting_seqs == 0 and fs.engine.num_unfinished == 0

        # A request that started in time runs to the end, however long it takes.
        fs.engine.core.paused = False
        r = await fs.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 40

    run(scenario, step_s=0.005, max_queue_time=0.1)


# --------------------------------------------------------------------------- input limits


BAD_INPUTS = [
    (COMPLETIONS, {"prompt": "hi", "n": 5}, "n"),  # beyond --max-n (4 here)
    (COMPLETIONS, {"prompt": "hi", "n": 65}, "n"),  # beyond the protocol's hard cap
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    (CHAT, chat_body(stop="x" * 513), "stop"),
    (CHAT, chat_body(stop=[""]), "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    (COMPLETIONS, {"prompt": "hi", "request_timeout": 0}, "request_timeout"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUTS)
def test_input_limits_give_400_naming_the_field(path, body, param):
    async def scenario(fs: FakeServer) -> None:
        for stream in (False, True):
            assert_openai_error(await fs.client.post(path, json={**body, "stream": stream}), 400, param)
        assert fs.engine.core.added == []

    run(scenario, max_n=4)


def test_oversized_headers_and_bodies_are_refused_and_the_server_keeps_serving():
    async def scenario(fs: FakeServer) -> None:
        # A body over --max-body-bytes: 413 before it is read, and the connection closes (fs.raw
        # reads until the server closes), so the unread rest is never taken for a request.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        reply = await fs.raw(head + b"Content-Length: 5000\r\n\r\n" + b"x" * 1000)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == 413

        pad = "x" * (40 * 2**10)
        assert (await fs.client.get("/health", headers={"X-Pad": pad})).status_code == 200  # under the bound
        head = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Pad: " + b"x" * (80 * 2**10) + b"\r\n\r\n"
        # Whole in one read (the app refuses it: 431), or trickling in (h11 gives up: 400); either
        # way the connection closes, and the server goes on serving.
        reply = await fs.raw(head)
        assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == 431
        reader, writer = await asyncio.open_connection("127.0.0.1", fs.port)
        reply = b""
        try:  # the server may close while the rest is still being sent: a reset is a refusal too
            for start in range(0, len(head), 8192):
                writer.write(head[start : start + 8192])
                await writer.drain()
                await asyncio.sleep(0.001)
            reply = await asyncio.wait_for(reader.read(), 5)
        except ConnectionError:
            reply = reader._buffer  # type: ignore[attr-defined]  # whatever arrived before the reset
        writer.close()
        assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")) or reply == b"", reply[:100]
        reply = await fs.raw(b"GET /v1/models?" + b"q" * 70_000 + b" HTTP/1.1\r\nHost: a\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 431"), reply[:100]  # a long target counts too
        assert (await fs.client.get("/health")).status_code == 200

    run(scenario, serve_http=True, max_body_bytes=4096)


def test_stalled_clients_time_out():
    async def scenario(fs: FakeServer) -> None:
        # Connects and sends nothing; sends half its headers; sends half its body: all cut off.
        started = time.monotonic()
        assert await fs.raw(b"", read_timeout=3) == b""
        assert 0.3 < time.monotonic() - started < 2
        assert await fs.raw(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n", read_timeout=3) == b""
        head = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        reply = await fs.raw(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ', read_timeout=3)
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408"), reply
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == 408 and error["type"] == "timeout_error"
        assert fs.engine.core.added == []

        # A kept-alive connection that is merely slower than the timeout between requests, and a
        # response that takes longer than it, are fine.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fs.port}", timeout=10) as client:
            r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 80, "ignore_eos": True})
            assert r.json()["usage"]["completion_tokens"] == 80
            await asyncio.sleep(0.2)
            assert (await client.get("/health")).status_code == 200

    run(scenario, serve_http=True, step_s=0.01, client_read_timeout=0.5)


def test_a_client_that_stops_reading_a_stream_is_cut_off():
    # It connects, asks for a long stream and never reads. Once the socket buffers are full the
    # server's writes cannot proceed; after --stream-write-timeout the stream ends, the request
    # is aborted in the engine and its admission released, and everyone else is served as usual.
    async def scenario(fs: FakeServer) -> None:
        import socket

        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 20_000, "ignore_eos": True, "n": 8,
                           "stream": True}).encode()  # fmt: skip
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", fs.port))
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        await loop.sock_sendall(sock, head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            await wait_until(lambda: len(fs.engine.core.added) == 8)  # n=8: eight engine sequences
            started = time.monotonic()
            await wait_until(lambda: len(fs.engine.core.aborted) == 8, timeout=8)
            assert time.monotonic() - started > 0.5  # the timeout, not something sooner
            assert fs.engine.core.running == {}
            await wait_until(lambda: fs.state.engine.num_unfinished == 0)
            r = await fs.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        finally:
            sock.close()

    run(scenario, serve_http=True, step_s=0.001, max_model_len=50_000, num_kv_blocks=50_000, socket_send_buffer=4096,
        stream_write_timeout=0.5)  # fmt: skip
