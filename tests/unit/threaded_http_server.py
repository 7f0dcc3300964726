"""A real aiohttp server on its own event loop thread, for tests that drive a client (the load
generator) against a scripted OpenAI-compatible fake. Subclasses add their routes."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class ThreadedHTTPServer:
    def __init__(self) -> None:
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @staticmethod
    def _event(body: dict) -> bytes:
        """One server-sent event carrying `body` as JSON."""
        return f"data: {json.dumps(body)}\n\n".encode()

    def start(self) -> None:
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app)
        self._thread.start()

        async def setup() -> str:
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            host, port = self._runner.addresses[0][:2]
            return f"http://{host}:{port}"

        self.base_url = asyncio.run_coroutine_threadsafe(setup(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
