"""Scripted OpenAI-compatible replicas on loopback sockets, and the router in front of them, all on
one event loop: routing, retries and stream cut-offs in well under a second each, with no model.

A replica answers /v1/chat/completions and /v1/completions with a fixed reply (streamed as SSE
chunks `chunk_s` apart, or whole), reports its load on /metrics the way tokenmill does, and can be
made unhealthy (/health 503) or killed: its listening socket closes (new connections are refused)
and every open connection is reset, as when the process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.router.app import Router, RouterSettings, create_router_app
from tokenmill.router.replicas import HealthSettings

NUM_CHUNKS = 4


@dataclass
class FakeReplica:
    name: str
    chunk_s: float = 0.01
    healthy: bool = True
    seen: list[dict] = field(default_factory=list)  # every generation payload, in arrival order
    running: int = 0
    extra_waiting: int = 0  # added to what /metrics reports as waiting (load from other clients)
    fail_status: int | None = None  # generation requests get this status (an error body) when set
    kv_transfer: tuple[str, str] | None = None  # (--kv-role, --kv-transfer-address) reported on /metrics
    server: uvicorn.Server | None = None
    task: asyncio.Task | None = None
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (
                f'tokenmill:num_requests_running{{model_name="tiny"}} {self.running}\n'
                f'tokenmill:num_requests_waiting{{model_name="tiny"}} {self.extra_waiting}\n'
            )
            if self.kv_transfer is not None:
                role, address = self.kv_transfer
                text += f'tokenmill:kv_transfer_info{{model_name="tiny",kv_role="{role}",kv_transfer_address="{address}"}} 1.0\n'
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny", "root": self.name}]}

        async def generate(request: Request) -> Response:
            payload = await request.json()
            self.seen.append(payload)
            if self.fail_status is not None:
                error = {"message": f"{self.name} refuses", "type": "x", "param": None, "code": self.fail_status}
                return JSONResponse({"error": error}, status_code=self.fail_status)
            if payload.get("stream"):
                return StreamingResponse(self._chunks(), media_type="text/event-stream")
            self.running += 1
            try:
                await asyncio.sleep(self.chunk_s * NUM_CHUNKS)
            finally:
                self.running -= 1
            return JSONResponse({"object": "chat.completion", "replica": self.name, "choices": []})

        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        app.add_api_route("/v1/completions", generate, methods=["POST"])
        return app

    async def _chunks(self) -> AsyncIterator[str]:
        self.running += 1
        try:
            for i in range(NUM_CHUNKS):
                yield f"data: {json.dumps({'replica': self.name, 'i': i})}\n\n"
                await asyncio.sleep(self.chunk_s)
            yield "data: [DONE]\n\n"
        finally:
            self.running -= 1

    async def start(self) -> None:
        self.server, self.task, self.url = await serve_app(self.app())

    def kill(self) -> None:
        """As if the process died: no new connections, every open one reset."""
        assert self.server is not None
        for listener in self.server.servers:
            listener.close()
        for connection in list(self.server.server_state.connections):
            connection.transport.abort()

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            self.server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 5)


async def serve_app(app: FastAPI, lifespan: str = "off") -> tuple[uvicorn.Server, asyncio.Task, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server._serve([sock]))  # _serve: no signal handlers in tests
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.005)
    return server, task, f"http://127.0.0.1:{port}"


@dataclass
class RouterRig:
    replicas: list[FakeReplica]
    router: Router
    client: httpx.AsyncClient  # talks to the router over a real socket

    def replica(self, url: str) -> FakeReplica:
        return next(r for r in self.replicas if r.url == url)


@contextlib.asynccontextmanager
async def router_rig(
    num_replicas: int = 2,
    *,
    policy: str = "cache_aware",
    chunk_s: float = 0.01,
    unhealthy_at_start: tuple[int, ...] = (),
    **settings,
) -> AsyncIterator[RouterRig]:
    replicas = [FakeReplica(f"r{i}", chunk_s=chunk_s) for i in range(num_replicas)]
    for i, replica in enumerate(replicas):
        replica.healthy = i not in unhealthy_at_start
        await replica.start()
    settings.setdefault("health", HealthSettings(interval_s=0.05, timeout_s=1.0, failure_threshold=2))
    router = Router(RouterSettings(replicas=[r.url for r in replicas], policy=policy, **settings))
    server, task, url = await serve_app(create_router_app(router), lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield RouterRig(replicas, router, client)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        for replica in replicas:
            await replica.stop()


def run(scenario, timeout: float = 20.0, **kwargs) -> None:
    async def main() -> None:
        async with router_rig(**kwargs) as rig:
            await asyncio.wait_for(scenario(rig), timeout)

    asyncio.run(main())
