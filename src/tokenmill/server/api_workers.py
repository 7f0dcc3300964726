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
the first waits for them before it stops the engine. Workers die with the first process
(PR_SET_PDEATHSIG).

A worker that dies otherwise (a crash, the OOM killer) is restarted in its slot: its clients'
connections are lost, the engine aborts its requests at once (told by the first process;
engine/client_links.py), and its live gauges leave the shared metrics (counters stay: totals never
go backwards). Restarting takes seconds where restarting the whole server reloads the model. More
than TOKENMILL_API_SERVER_RESTARTS deaths within RESTART_WINDOW_S, or a restart that fails, stops
the server (drain, then exit code 1) for a supervisor to restart whole.
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
from prometheus_client import multiprocess

from tokenmill import envs

logger = logging.getLogger("tokenmill.server")

WATCH_INTERVAL_S = 0.2
RESTART_WINDOW_S = 300.0


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
        self.specs: list[WorkerSpec] = []
        self.ready_timeout_s = 0.0
        self._signalled = False
        self._deaths: list[float] = []  # when workers died (restart budget)
        self.stopping = False

    async def start(self, specs: list[WorkerSpec], ready_timeout_s: float) -> None:
        """Spawns one worker per spec and waits until each has attached; RuntimeError naming the
        first that fails (the others are stopped by `stop`)."""
        self.specs, self.ready_timeout_s = list(specs), ready_timeout_s
        self.processes = [_spawn(spec) for spec in specs]
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
            _tell_to_serve(process)

    async def watch(self, on_fatal: Callable[[str], None], on_exit: Callable[[int, int], None]) -> None:
        """Restarts workers that die (module docstring); calls `on_exit(slot, pid)` for each death
        (the engine aborts that process's requests) and `on_fatal` when one may not be restarted."""
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for index, process in enumerate(self.processes):
                if self.stopping or process.poll() is None:
                    continue
                on_exit(index + 1, process.pid)
                reason = f"API server process {index + 1} (pid {process.pid}) exited with code {process.returncode}"
                now = time.monotonic()
                self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
                allowed = envs.TOKENMILL_API_SERVER_RESTARTS.get() or 0
                if len(self._deaths) > allowed:
                    on_fatal(
                        f"{reason}; {len(self._deaths)} exits within {RESTART_WINDOW_S:.0f} s, more than "
                        f"TOKENMILL_API_SERVER_RESTARTS={allowed} allows"
                    )
                    return
                logger.error("%s; restarting it", reason)
                # Its live gauges (LoRA requests in flight) stop counting; its counters stay.
                multiprocess.mark_process_dead(process.pid, self.specs[index].metrics_dir)
                try:
                    await self._restart(index)
                except RuntimeError as exc:
                    if not self.stopping:
                        on_fatal(f"{reason}; restarting it failed: {exc}")
                    return

    def kill_stalled(self, slot: int, pid: int) -> None:
        """The engine gave up on process `pid` in `slot` (it left the engine's messages unread past
        TOKENMILL_API_SERVER_STALL_TIMEOUT) and aborted its requests: it is killed, and `watch`
        restarts it like any process that dies. Several cores each report it; one kill is enough."""
        if not 1 <= slot <= len(self.processes):
            return
        process = self.processes[slot - 1]
        if process.pid != pid or process.poll() is not None:
            return  # already gone, or already replaced
        logger.error("API server process %d (pid %d) stopped reading the engine's messages; killing it", slot, pid)
        with contextlib.suppress(ProcessLookupError):
            process.kill()

    async def _restart(self, index: int) -> None:
        process = self.processes[index] = _spawn(self.specs[index])
        await asyncio.to_thread(_read_ready, process, self.ready_timeout_s)
        if self.stopping:  # drained meanwhile: it gets no "serve" and its SIGTERM ends it
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            return
        _tell_to_serve(process)
        logger.warning("API server process %d restarted (pid %d)", index + 1, process.pid)

    def drain(self) -> None:
        """Passes one SIGTERM on (a second would make a worker exit without draining)."""
        self.stopping = True
        if self._signalled:
            return
        self._signalled = True
        self._terminate_running()

    def force(self) -> None:
        """A second signal: the workers get theirs and stop without draining."""
        self.drain()
        self._terminate_running()

    def _terminate_running(self) -> None:
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


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.server.api_worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdin is not None
    try:
        process.stdin.write(msgspec.json.encode(spec) + b"\n")  # JSON escapes newlines: one line
        process.stdin.flush()
    except OSError:  # it died at once; _read_ready reports its exit code
        pass
    return process


def _tell_to_serve(process: subprocess.Popen) -> None:
    assert process.stdin is not None
    try:
        process.stdin.write(b"serve\n")
        process.stdin.close()
    except OSError:  # it died meanwhile: the watch sees it
        pass


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
