"""The engine-core client of an API server process that did not spawn the engine.

`serve --api-server-count N` starts one engine process from the first API server process (its
`CoreProcessClient`) and N - 1 more API server processes once the engine is ready. Each of those
binds the pair of sockets the engine was told to connect to for its slot
(engine/client_links.py), says Hello, and from then on talks to the engine like the first one:
its requests' outputs and the engine's stats come back on its own socket.

It never stops the engine: the first process owns its life (Shutdown, reaping). It watches it all
the same: an engine process that is gone or silent past the hang timeout while requests wait
fails this process's requests too, and /health answers 503 here as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from tokenmill.config import EngineConfig
from tokenmill.engine.client_links import slot_addresses
from tokenmill.engine.core_process_client import DEFAULT_HANG_TIMEOUT_S, CoreProcessClient
from tokenmill.engine.messages import Hello


class AttachedCoreClient(CoreProcessClient):
    def __init__(
        self,
        config: EngineConfig,
        *,
        ipc_dir: str,
        slot: int,
        engine_pid: int,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> None:
        if slot < 1:
            raise ValueError(f"slot 0 belongs to the API server process that spawns the engine; got {slot}")
        self._slot = slot
        self._engine_pid = engine_pid
        self._gone = False
        # The first API server's directory, where the engine looks for this slot's sockets.
        super().__init__(config, hang_timeout_s=hang_timeout_s, ipc_dir=ipc_dir)

    @property
    def engine_pid(self) -> int | None:
        return self._engine_pid

    def launch(self, config: EngineConfig) -> None:
        """Binds this slot's sockets (the engine is already running and connects to them)."""
        self.config = config
        self._bind(self._slot)

    async def wait_until_ready(self, ready_timeout_s: float) -> None:
        # Sent once the engine's connection is up (a send waits for a peer), answered EngineReady.
        await asyncio.wait_for(self._send(Hello(pid=os.getpid())), ready_timeout_s)
        await super().wait_until_ready(ready_timeout_s)

    async def _stop_engine(self, timeout_s: float) -> None:
        """Nothing: the engine keeps running for the other API server processes (the first one
        stops it); `shutdown` only closes this process's sockets."""

    def _remove_sockets(self) -> None:
        for address in slot_addresses(self.ipc_dir, self._slot):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.removeprefix("ipc://"))

    def _exit_status(self) -> str | None:
        # Not this process's child: whether the pid still exists. The parent reaps a dead engine
        # within its watchdog's interval, after which the pid is gone.
        if self._gone:
            return "gone"
        try:
            os.kill(self._engine_pid, 0)
        except ProcessLookupError:
            self._gone = True
            return "gone"
        except PermissionError:  # another user's process took the pid: ours is gone
            self._gone = True
            return "gone"
        return None

    def _kill(self) -> None:
        if self._exit_status() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._engine_pid, signal.SIGKILL)
