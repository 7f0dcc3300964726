"""uvicorn's HTTP/1.1 settings for `tokenmill serve`: bounded headers, and clients that stall time out.

uvicorn bounds the time between requests on a kept-alive connection (`timeout_keep_alive`) but not
the time a client may take to send a request's headers: one that connects and trickles a byte
now and then holds its connection for ever. The protocol here closes any connection whose next
request's headers are not complete within the client timeout (read_body bounds the body the
same way). h11 is chosen explicitly because its `max_incomplete_event_size` is what bounds the
size of the request line plus headers; beyond it the client gets 400 and the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class that closes the connection when a request's headers take longer
    than `timeout_s` to arrive (counted from the connection's start or the previous response)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timeout_s = timeout_s
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request on this connection gets the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            # IDLE: h11 has not seen a whole request line and headers since the last response.
            # A request being served (or its body being read, which read_body bounds) is left alone.
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return HeaderTimeoutH11Protocol


def make_uvicorn_config(
    app: Any,
    *,
    host: str,
    port: int,
    max_header_bytes: int = 64 * 2**10,
    client_read_timeout: float = 30.0,
    keep_alive_timeout: float = 5.0,
    timeout_graceful_shutdown: float | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    ssl_ca_certs: str | None = None,
    access_log: bool = False,
) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_timeout_protocol(client_read_timeout),
        h11_max_incomplete_event_size=max_header_bytes,
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]  # uvicorn takes seconds as int or float
        log_level="warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=timeout_graceful_shutdown,  # type: ignore[arg-type]
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        ssl_ca_certs=ssl_ca_certs,
    )
    if access_log:  # one INFO line per request ("GET /v1/models HTTP/1.1" 200); uvicorn's own at WARNING
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config
