"""The listening sockets of `serve --api-server-count N`: one per API server process, all on the
same port with SO_REUSEPORT, so the kernel spreads new connections over the processes by a hash of
each connection's addresses.

One socket inherited by every process was tried first: every process then wakes for each new
connection and asyncio accepts up to its backlog in one go, so whichever process wakes first takes a
whole burst of connections (a benchmark's 128 opened at once landed almost all on one process
while the other idled). With a socket each, the split does not depend on which process is
quicker to wake.

Linux lets only sockets of the same user join a port's group, and only sockets that all set
SO_REUSEPORT; so before the first process binds, the port is checked free with a plain bind:
another server on it (even another `--api-server-count` one) is refused instead of joined.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides


def check_port_free(host: str, port: int) -> None:
    """OSError naming the address when anything listens on it (a plain bind fails)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) in the port's SO_REUSEPORT group."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
