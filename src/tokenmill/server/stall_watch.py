"""Ending a stream whose client stopped reading, without a timer for every write.

A streamed response writes one SSE event per token. Wrapping each write in `asyncio.timeout`
made and cancelled a timer handle per event: 4 us of the API server's ~67 us a streamed token on
the 2-core dev machine (benchmarks/api_stream_backlog.py), and at a saturated GPU's 10,000
events a second that is CPU the event loop spends before the next step's outputs. A `StallWatch`
keeps one timer per stream instead: each write only records when it started, and the timer, when
it fires, either finds no write pending for `timeout` seconds and re-arms itself, or cancels the
writing task, which the watch turns into `ClientStalled` (as `asyncio.timeout` turns its own
cancellation into TimeoutError). A write pending for `timeout` seconds is caught when its
`timeout` ends, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class ClientStalled(Exception):  # not an OSError: starlette turns those into ClientDisconnect
    pass


class StallWatch:
    def __init__(self, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"a stall timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.stalled = False
        self._pending_since: float | None = None  # loop time the write in progress started
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._cancelling = 0

    async def send(self, send: Callable[[Any], Awaitable[None]], message: Any) -> None:
        """`await send(message)`, raising ClientStalled when it stays pending `timeout` seconds."""
        loop = self._loop
        if loop is None:  # the first write: the task that writes the stream, and the watch's timer
            loop = self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._timer = loop.call_at(loop.time() + self.timeout, self._check)
        self._pending_since = loop.time()
        try:
            await send(message)
        except asyncio.CancelledError:
            # Ours only if nothing else cancelled the task too (server shutdown): as asyncio.timeout.
            if self.stalled and self._task is not None and self._task.uncancel() <= self._cancelling:
                raise ClientStalled from None
            raise
        finally:
            self._pending_since = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        assert self._loop is not None and self._task is not None
        now = self._loop.time()
        since = self._pending_since
        if since is not None and now - since >= self.timeout:
            self.stalled = True
            self._cancelling = self._task.cancelling()
            self._task.cancel()
            self._timer = None
            return
        # Idle between writes, or a write younger than the timeout: look again when it would expire.
        self._timer = self._loop.call_at((now if since is None else since) + self.timeout, self._check)
