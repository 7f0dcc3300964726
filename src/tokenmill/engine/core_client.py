"""The engine-core client: how a frontend reaches an engine core, wherever that core runs.

A frontend (the offline `LLM`, the API server's `AsyncEngine`) turns user requests into
`EngineCoreRequest`s (validation, tokenization, n > 1 fan-out) and engine outputs into
`RequestOutput`s (detokenization, stop strings, logprobs). Between the two sits a client, the one
thing that knows where the engine core is and how to talk to it:

- `InprocClient`: the `EngineCore` in this process, stepped by the caller (the offline `LLM`).
- `CoreProcessClient` (core_process_client.py): the engine core in a child process, spawned and
  watched by the client (ZMQ + msgspec msgpack, a watchdog for death and hangs); asynchronous, for
  the API server's event loop.

A router or a data-parallel front end is one more client, with the frontend above it unchanged:
it holds one `CoreProcessClient` per engine-core process, and
- `add_requests` picks an engine for each request (the least loaded by each engine's last stats,
  or the one that holds the prompt's prefix blocks, by hashing its first block) and remembers it;
- `abort_requests` sends each id to the engine that has it;
- outputs of every engine reach the same `on_outputs` callback (stats summed per engine);
- `call_utility` asks every engine and merges the answers;
- it is dead when the engines it needs are, and `engine_pid` becomes one pid per engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.messages import EngineCoreRequest, EngineInfo

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

    def call_utility(self, method: str) -> dict[str, float]:
        """The calls the core process answers (see core_process._utility): get_stats, check_invariants."""
        if method == "check_invariants":
            self.engine_core.check_invariants()
        elif method != "get_stats":
            raise ValueError(f"unknown utility method {method!r}")
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
