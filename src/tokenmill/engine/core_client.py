"""The engine-core client: how a frontend reaches an engine core, wherever that core runs.

A frontend (the offline `LLM`, the API server's `AsyncEngine`) turns user requests into
`EngineCoreRequest`s (validation, tokenization, n > 1 fan-out) and engine outputs into
`RequestOutput`s (detokenization, stop strings, logprobs). Between the two sits a client, the one
thing that knows where the engine core is and how to talk to it:

- `InprocClient`: the `EngineCore` in this process, stepped by the caller (the offline `LLM`).
- `CoreProcessClient` (core_process_client.py): the engine core in a child process, spawned and
  watched by the client (ZMQ + msgspec msgpack, a watchdog for death and hangs); asynchronous, for
  the API server's event loop.
- `DataParallelClient` (dp_client.py): N `CoreProcessClient`s behind one frontend
  (`serve --data-parallel-size N`); each request goes to one core by the router's cache-aware
  policy (router/policy.py), aborts go to the owning core, stats are merged, utility calls reach
  every core.

The HTTP router (`tokenmill router`, router/) sits in front of whole servers instead and shares
that policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.messages import EngineCoreRequest, EngineInfo, StepOutputs
from tokenmill.errors import EngineDeadError

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore


class EngineCoreClient(ABC):
    """What every client offers. `abort_requests` never blocks and never suspends: frontends call it
    from clean-up code that must run to its end (a cancelled task's `finally`)."""

    info: EngineInfo | None = None
    dead: str | None = None  # why the engine core is gone; None while it serves

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Ends these sequences in the engine core; it frees their blocks at its next step."""


def _no_waiters() -> int:
    return 0


class AsyncEngineCoreClient(EngineCoreClient):
    """A client for a frontend on an asyncio loop (the API server's AsyncEngine).

    Life cycle: `launch()`, `await wait_until_ready()` (then `info` is set), `start_loops()` once
    the frontend can take outputs, `await shutdown()`. Outputs are pushed, not pulled: the client
    calls `on_outputs` with every StepOutputs it receives and `on_dead` once the engine is gone; the
    frontend sets both, and `num_waiting` (how many user requests wait on the engine, so an idle
    engine is never declared hung), before `start_loops()`.
    """

    def __init__(self) -> None:
        self.on_outputs: Callable[[StepOutputs], None] = lambda message: None
        self.on_dead: Callable[[EngineDeadError], None] = lambda error: None
        # `serve --api-server-count`, the first process: the engine gave up on another API server
        # process (slot, pid) that stopped reading; its supervisor kills it (server/api_workers.py).
        self.on_api_server_stalled: Callable[[int, int], None] = lambda slot, pid: None
        self.num_waiting: Callable[[], int] = _no_waiters

    @abstractmethod
    def launch(self, config: EngineConfig) -> None:
        """Starts the engine core(s) on `config` (the frontend's, its Hub revisions pinned to the
        snapshots it resolved); they load the model from here on. Returns at once."""

    @abstractmethod
    async def wait_until_ready(self, ready_timeout_s: float) -> None:
        """Waits until the engine core serves; raises if it fails or exits first."""

    @abstractmethod
    def start_loops(self) -> None:
        """Starts receiving outputs (into `on_outputs`) and watching the engine core(s)."""

    @abstractmethod
    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Sends the requests; raises EngineDeadError if the engine is gone."""

    @abstractmethod
    async def call_utility(
        self, method: str, timeout_s: float = 30.0, args: dict[str, str | int | None] | None = None
    ) -> dict[str, float]:
        """An out-of-band call answered by the engine core (engine.core_process.run_utility):
        get_stats, check_invariants, add_lora, remove_lora."""

    @abstractmethod
    def mark_dead(self, reason: str) -> None:
        """Declares the engine gone: `on_dead` runs, waiting utility calls fail, later calls too."""

    @abstractmethod
    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the engine core(s) and frees everything; the engine is dead afterwards."""

    @property
    @abstractmethod
    def engine_pid(self) -> int | None:
        """The engine-core process's pid (None while none runs)."""

    @property
    @abstractmethod
    def hang_timeout_s(self) -> float:
        """Silence (seconds) after which a waited-on engine is declared hung; 0: never."""


class InprocClient(EngineCoreClient):
    """The engine core in this process: each `get_output` runs one step, on the caller's thread."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.info = engine_core.info

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.engine_core.has_work()

    def get_output(self) -> list[EngineCoreOutput]:
        """Runs one engine step and returns what it produced."""
        return self.engine_core.step()

    def call_utility(self, method: str, args: dict[str, str | int | None] | None = None) -> dict[str, float]:
        """The calls the core process answers (core_process.run_utility), on this thread."""
        from tokenmill.engine.core_process import run_utility

        return run_utility(self.engine_core, method, args or {})

    def shutdown(self) -> None:
        self.engine_core.shutdown()
