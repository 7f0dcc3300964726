"""The real HTTP stack (create_app, optionally uvicorn on a loopback socket with `serve`'s own
settings) over the scripted FakeEngine: limits, deadlines and security checks in well under a
second each, with no model and no subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import uvicorn

from tests.server.fake_engine import FakeEngine, fake_server_state
from tokenmill.engine.async_engine import DEFAULT_HANG_TIMEOUT_S
from tokenmill.server.api_server import create_app
from tokenmill.server.http_protocol import make_uvicorn_config
from tokenmill.server.state import ServerState


@dataclass
class FakeServer:
    state: ServerState
    engine: FakeEngine
    client: httpx.AsyncClient
    port: int | None = None  # set when uvicorn serves it on 127.0.0.1

    async def raw(self, data: bytes, *, read_timeout: float = 5.0) -> bytes:
        """Sends `data` on a fresh TCP connection and returns all it gets until the server closes."""
        assert self.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(data)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), read_timeout)
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def fake_server(
    *,
    serve_http: bool = False,
    step_s: float = 0.001,
    keep_alive_timeout: float = 5.0,
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    max_model_len: int = 128,
    num_kv_blocks: int = 64,
    socket_send_buffer: int | None = None,
    **state_kwargs,
) -> AsyncIterator[FakeServer]:
    """`socket_send_buffer` sets SO_SNDBUF on the listening socket (accepted connections inherit
    it), so a client that stops reading fills the server's buffers after a few kB, not MBs."""
    engine = FakeEngine(
        step_s=step_s,
        hang_timeout_s=hang_timeout_s,
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
    )
    await engine.start()
    state = fake_server_state(engine, **state_kwargs)
    app = create_app(state)
    server = None
    serving = None
    port = None
    if serve_http:
        sock = socket.socket()
        if socket_send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_send_buffer)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = make_uvicorn_config(
            app,
            host="127.0.0.1",
            port=port,
            max_header_bytes=state.max_header_bytes,
            client_read_timeout=state.client_read_timeout or 30.0,
            keep_alive_timeout=keep_alive_timeout,
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server._serve([sock]))  # _serve: no signal handlers in tests
        while not server.started:
            assert not serving.done(), serving.exception()
            await asyncio.sleep(0.005)
        transport = httpx.AsyncHTTPTransport()
        base_url = f"http://127.0.0.1:{port}"
    else:
        transport = httpx.ASGITransport(app=app)
        base_url = "http://test"
    try:
        async with httpx.AsyncClient(transport=transport, base_url=base_url, timeout=10) as client:
            yield FakeServer(state, engine, client, port)
    finally:
        if server is not None and serving is not None:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)
        await engine.shutdown()


def run(scenario: Callable[[FakeServer], Awaitable[None]], timeout: float = 10.0, **kwargs) -> None:
    async def main() -> None:
        async with fake_server(**kwargs) as fs:
            await asyncio.wait_for(scenario(fs), timeout)

    asyncio.run(main())


def sse_payloads(text: str) -> list[str]:
    """The data payloads of an SSE body (the last one `[DONE]`), checking the framing."""
    assert text.endswith("\n\n"), text[-80:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    payloads = [e.removeprefix("data: ") for e in events]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    return payloads


def sse_json(text: str) -> list[dict]:
    return [json.loads(p) for p in sse_payloads(text)[:-1]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error
