"""The client of an engine core in its own process: spawns it, talks to it, watches it.

Used by the API server's `AsyncEngine` (the frontend), on its event loop. Requests go out as
msgspec msgpack over ZMQ (never pickle); outputs come back the same way and go to the frontend's
`on_outputs`. A watchdog declares the engine dead when its process exits or when it stays silent
longer than the hang timeout while requests wait on it; the frontend hears it through `on_dead`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.client_links import slot_addresses
from tokenmill.engine.core_client import AsyncEngineCoreClient
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    ApiServerGone,
    ApiServerStalled,
    EngineCoreRequest,
    EngineMessage,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2
SEND_RETRY_S = 0.002
# The engine process speaks after every step and every STATS_INTERVAL_S (0.5 s) while idle, so a
# silence this long while requests wait on it means it hangs (a deadlock, a stuck kernel, a stopped
# process); set by `serve --engine-hang-timeout`, 0 turns the check off.
DEFAULT_HANG_TIMEOUT_S = 120.0


def _kill_if_alive(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(5.0)


def _spawn_engine_process(
    config: EngineConfig, addresses: list[tuple[str, str]], env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Starts `python -m tokenmill.engine.core_process` with the config's msgpack on its stdin.

    A plain subprocess rather than multiprocessing, whose spawn start method pickles the target
    and its arguments over a pipe: here only msgpack and command-line strings cross. The child
    stays in this session and process group (Ctrl-C reaches both; the engine ignores it and
    waits for the server's Shutdown), inherits no file descriptor but stdio (close_fds), so it
    never holds the listening socket, and dies with this process (see core_process).
    Must run on the thread that lives as long as the server: PR_SET_PDEATHSIG fires when the
    creating *thread* exits.
    """
    command = [sys.executable, "-m", "tokenmill.engine.core_process"]
    for input_addr, output_addr in addresses:  # one pair per API server process, this one's first
        command += ["--input-addr", input_addr, "--output-addr", output_addr]
    command += [
        "--parent-pid", str(os.getpid()),
        # `tokenmill --log-level` reaches the engine process too.
        "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, close_fds=True, start_new_session=False,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    assert process.stdin is not None
    try:
        process.stdin.write(msgspec.msgpack.encode(config))
        process.stdin.close()
    except OSError:  # it died at once; wait_until_ready reports its exit code
        pass
    return process


def _private_dir() -> str:
    ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")
    os.chmod(ipc_dir, 0o700)  # only this user may reach the sockets
    return ipc_dir


class CoreProcessClient(AsyncEngineCoreClient):
    """One engine-core process (`python -m tokenmill.engine.core_process`); see AsyncEngineCoreClient
    for the life cycle and the frontend's callbacks."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        env: dict[str, str] | None = None,  # set in the engine process's environment (data parallelism)
        num_api_servers: int = 1,  # API server processes the engine answers (`serve --api-server-count`)
        ipc_dir: str | None = None,  # where the sockets are; None: a new private directory
    ) -> None:
        if hang_timeout_s < 0:
            raise ValueError(f"hang_timeout_s must be >= 0 (0 disables the check), got {hang_timeout_s}")
        super().__init__()
        self.config = config
        self._hang_timeout_s = hang_timeout_s
        self._env = env
        self.last_heard = time.monotonic()  # when the engine process last sent anything
        self.info = None
        self.dead = None
        self._ids = 0
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._process: subprocess.Popen | None = None
        self.num_api_servers = num_api_servers
        self.ipc_dir = ipc_dir if ipc_dir is not None else _private_dir()
        # Sends go through a plain socket with NOBLOCK so a dead or stalled engine can never block
        # the event loop or a request forever; receives through an asyncio one.
        self._send_ctx = zmq.Context()
        self._to_engine = self._send_ctx.socket(zmq.PUSH)
        self._ctx = zmq.asyncio.Context()
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._stopping = False
        self._closed = False
        self._background: set[asyncio.Task] = set()

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def hang_timeout_s(self) -> float:
        return self._hang_timeout_s

    def _bind(self, slot: int) -> None:
        input_addr, output_addr = slot_addresses(self.ipc_dir, slot)
        self._to_engine.bind(input_addr)
        self._from_engine.bind(output_addr)

    def launch(self, config: EngineConfig) -> None:
        """Binds the sockets and spawns the engine process on `config`; it loads the model from here on.
        The other API server processes bind theirs later (AttachedCoreClient)."""
        self.config = config
        self._bind(0)
        addresses = [slot_addresses(self.ipc_dir, slot) for slot in range(self.num_api_servers)]
        self._process = _spawn_engine_process(self.config, addresses, self._env)
        # If this process exits without shutdown() (an exception in the caller), kill the engine
        # rather than leave it to notice the parent is gone.
        atexit.register(_kill_if_alive, self._process)
        logger.info("engine process %d started; loading the model", self._process.pid)

    async def wait_until_ready(self, ready_timeout_s: float) -> None:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if await self._from_engine.poll(500):
                message = self._decoder.decode(await self._from_engine.recv())
                if isinstance(message, EngineReady):
                    if message.error:
                        raise RuntimeError(message.error)
                    self.info = message.info
                    return
                continue
            gone = self._exit_status()
            if gone is not None:  # checked after the poll, so its last words are read
                raise RuntimeError(f"the engine process exited during start-up ({gone})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine was not ready after {ready_timeout_s:.0f} s")

    def start_loops(self) -> None:
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the engine process (asking first, then SIGKILL) and reaps it."""
        if self._closed:
            return
        self._stopping = True
        await self._stop_engine(timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.mark_dead("the server is shutting down")
        self._closed = True
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._send_ctx.term()
        self._ctx.term()
        self._remove_sockets()

    async def _stop_engine(self, timeout_s: float) -> None:
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._to_engine.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            if not await self._wait_for_exit(timeout_s):  # it ignores SIGTERM (see core_process)
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
                self._process.kill()
                await self._wait_for_exit(5.0)

    def _remove_sockets(self) -> None:
        # Every API server's socket files: the others have stopped by now (the launcher waits).
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _exit_status(self) -> str | None:
        """How the engine process ended ("exit code N"), reaping it; None while it runs."""
        if self._process is None or self._process.poll() is None:
            return None
        return f"exit code {self._process.returncode}"

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too

    async def _wait_for_exit(self, timeout_s: float) -> bool:
        """Waits (without blocking the loop) for the engine process to exit and reaps it."""
        deadline = time.monotonic() + timeout_s
        while self._exit_status() is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- requests -----------------------------------------------------------------------------

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        await self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send_nowait(AbortRequests(request_ids))

    def api_server_gone(self, slot: int, pid: int) -> None:
        """Another API server process (`serve --api-server-count`, process `pid` in `slot`) exited:
        the engine aborts its requests now rather than when its replacement attaches."""
        self._send_nowait(ApiServerGone(slot=slot, pid=pid))

    async def call_utility(
        self, method: str, timeout_s: float = 30.0, args: dict[str, str | int | None] | None = None
    ) -> dict[str, float]:
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        self._ids += 1
        call_id = self._ids
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            await self._send(UtilityCall(call_id, method, args or {}))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_calls.pop(call_id, None)

    # -- sending ------------------------------------------------------------------------------

    def _try_send(self, data: bytes) -> bool:
        try:
            self._to_engine.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:  # the engine is not keeping up (or gone): queue full
            return False
        return True

    async def _send(self, message: Any) -> None:
        """Sends without ever blocking the loop; waits while the engine's inbox is full, and fails
        with EngineDeadError instead of waiting forever when the engine dies meanwhile."""
        data = self._encoder.encode(message)
        while True:
            if self.dead:
                raise EngineDeadError(f"the engine is not available: {self.dead}")
            if self._try_send(data):
                return
            await asyncio.sleep(SEND_RETRY_S)

    def _send_nowait(self, message: Any) -> None:
        """Sends from code that must not suspend (aborts); a full inbox hands it to a task."""
        if self.dead or self._closed:
            return
        data = self._encoder.encode(message)
        if not self._try_send(data):
            task = asyncio.get_running_loop().create_task(self._send_later(data))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_later(self, data: bytes) -> None:
        while not self.dead and not self._closed:
            if self._try_send(data):
                return
            await asyncio.sleep(SEND_RETRY_S)

    # -- receiving ----------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle_message(self._decoder.decode(await self._from_engine.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging
            logger.exception("output loop failed")
            self.mark_dead(f"output loop failed: {exc}")

    def _handle_message(self, message: Any) -> None:
        """One message from the engine process (it is alive and speaking)."""
        self.last_heard = time.monotonic()
        if isinstance(message, StepOutputs):
            self.on_outputs(message)
        elif isinstance(message, ApiServerStalled):
            self.on_api_server_stalled(message.slot, message.pid)
        elif isinstance(message, UtilityResult):
            future = self._utility_calls.get(message.call_id)
            if future is not None and not future.done():
                if message.error:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result or {})

    # -- death and hangs ----------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            gone = self._exit_status()
            if gone is not None:
                if not self._stopping:
                    logger.error("the engine process died (%s)", gone)
                self.mark_dead(f"the engine process exited ({gone})")
                return
            if self._is_hung():
                await self._kill_hung_engine()
                return

    def _is_hung(self) -> bool:
        """Silent for longer than the hang timeout while requests (or utility calls) wait on it."""
        if self.hang_timeout_s <= 0 or self._stopping or self.dead is not None:
            return False
        if not self.num_waiting() and not self._utility_calls:
            return False  # an idle engine is not waited on; the first request after a hang finds it
        if time.monotonic() - self.last_heard <= self.hang_timeout_s:
            return False
        # Messages already waiting in the socket mean this loop, not the engine, was slow (a long
        # stall of the event loop); the output loop will read them next.
        return not (self._from_engine.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def _kill_hung_engine(self) -> None:
        """A hung engine is handled as a dead one: killed, its requests failed, /health 503."""
        silent_s = time.monotonic() - self.last_heard
        pid = self.engine_pid
        logger.error(
            "the engine process (pid %s) sent nothing for %.1f s while %d requests waited on it, longer "
            "than --engine-hang-timeout %g s; killing it",
            pid, silent_s, self.num_waiting(), self.hang_timeout_s,
        )  # fmt: skip
        self.mark_dead(
            f"the engine process hung: silent for {silent_s:.1f} s, longer than --engine-hang-timeout "
            f"{self.hang_timeout_s:g} s; it was killed"
        )
        if self._exit_status() is None:
            self._kill()
            if not await self._wait_for_exit(5.0):
                logger.error("the hung engine process %s did not exit after SIGKILL", pid)

    def mark_dead(self, reason: str) -> None:
        """The first reason given is the one kept."""
        if self.dead is None:
            self.dead = reason
        error = EngineDeadError(f"the engine is not available: {self.dead}")
        self.on_dead(error)
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
