"""`serve --api-server-count N`: the first API server process starts and watches the other N - 1.

One API server process turns a loaded GPU server's outputs into SSE chunks on one CPU core; at
saturation that core is the queue (benchmarks/BENCHMARKS.md, issue 24). With N processes the
work is split by connection: each process listens on the same port (SO_REUSEPORT, listen_socket.py)
and has its own engine-core client slot (engine/client_links.py).

The first process spawns the engine and, once it is ready (and --lora-modules are loaded), the
others: `python -m tokenmill.server.api_worker`, their start-up spec (the parsed flags, their
slot, the engine processes, the metrics directory) as one line of JSON on stdin. Each attaches and
answers one line on stdout ("ready", or why it could not); once all have, the first process turns
ready and writes "serve" to each, which then binds its socket and serves. So no process answers
before the others can (a connection hashed to one still starting would get 503).

Signals: the workers lead their own sessions, so a Ctrl-C reaches only the first process, which
passes one SIGTERM on as it starts draining; each worker drains its own requests and exits, and
the first waits for them before it stops the engine. A worker that dies otherwise stops the server
(drain, then exit code 1): a supervisor restarts it whole. Workers die with the first process
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

logger = logging.getLogger("tokenmill.server")

WATCH_INTERVAL_S = 0.2


class WorkerEngine(msgspec.Struct):
    """One engine-core process as a worker reaches it: its socket directory and pid."""

    ipc_dir: str
    pid: int


class WorkerAdapter(msgspec.Struct):
    """A --lora-modules adapter the first process loaded into the engine (workers register it)."""

    name: str
    lora_int_id: int
    path: str
    base_model_name: str


class WorkerSpec(msgspec.Struct):
    args: dict[str, Any]  # the parsed `tokenmill serve` flags (vars of the Namespace)
    slot: int  # 1..N-1; 0 is the first process
    engines: list[WorkerEngine]  # one per engine core (data parallelism: several)
    metrics_dir: str
    adapters: list[WorkerAdapter] = []


class ApiWorkers:
    """The first process's view of the other API server processes."""

    def __init__(self, count: int) -> None:
        self.count = count  # workers, not counting the first process
        self.processes: list[subprocess.Popen] = []
        self._signalled = False
        self.stopping = False

    async def start(self, specs: list[WorkerSpec], ready_timeout_s: float) -> None:
        """Spawns one worker per spec and waits until each serves; RuntimeError naming the first
        that fails (the others are stopped by `stop`)."""
        for spec in specs:
            command = [sys.executable, "-m", "tokenmill.server.api_worker"]
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, start_new_session=True,
            )  # fmt: skip
            self.processes.append(process)
            assert process.stdin is not None
            try:
                process.stdin.write(msgspec.json.encode(spec) + b"\n")  # JSON escapes newlines: one line
                process.stdin.flush()
            except OSError:  # it died at once; its exit code is reported below
                pass
        results = await asyncio.gather(
            *(asyncio.to_thread(_read_ready, p, ready_timeout_s) for p in self.processes),
            return_exceptions=True,
        )
        for slot, result in enumerate(results, start=1):
            if isinstance(result, BaseException):
                raise RuntimeError(f"API server process {slot} of {self.count + 1}: {result}") from result

    def serve(self) -> None:
        """All are ready: each binds its socket and serves from now on."""
        for process in self.processes:
            assert process.stdin is not None
            try:
                process.stdin.write(b"serve\n")
                process.stdin.close()
            except OSError:  # it died meanwhile: the watch reports it
                pass

    def died(self) -> str | None:
        """Why a worker is gone when nobody stopped it; None while all run (or once stopping)."""
        if self.stopping:
            return None
        for slot, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return f"API server process {slot} (pid {process.pid}) exited with code {process.returncode}"
        return None

    async def watch(self, on_death: Callable[[str], None]) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            reason = self.died()
            if reason is not None:
                on_death(reason)
                return

    def drain(self) -> None:
        """Passes one SIGTERM on (a second would make a worker exit without draining)."""
        self.stopping = True
        if self._signalled:
            return
        self._signalled = True
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)

    def force(self) -> None:
        """A second signal: the workers get theirs and stop without draining."""
        self.drain()
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)

    async def stop(self, timeout_s: float) -> None:
        """Drains the workers (if not yet asked), waits up to `timeout_s` for them, kills the rest."""
        self.drain()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for slot, process in enumerate(self.processes, start=1):
            if process.poll() is None:
                logger.warning("API server process %d (pid %d) did not stop; killing it", slot, process.pid)
                process.kill()
                await asyncio.to_thread(process.wait, 5.0)


def _read_ready(process: subprocess.Popen, timeout_s: float) -> None:
    """The worker's one line: "ready", or why it could not start (then it exits)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    received = b""
    while b"\n" not in received:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            chunk = None
        if chunk == b"":  # closed: the worker exited
            process.wait(5.0)
            raise RuntimeError(f"exited during start-up (exit code {process.returncode})")
        if chunk:
            received += chunk
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"not serving after {timeout_s:.0f} s")
        time.sleep(0.02)
    line = received.split(b"\n", 1)[0].decode(errors="replace").strip()
    if line != "ready":
        raise RuntimeError(line)
