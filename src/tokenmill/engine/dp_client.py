"""Data parallelism: N engine-core processes behind one API server (`serve --data-parallel-size N`).

Each core is a whole engine (its own model copy, KV pool, scheduler) in its own process, reached
through its own `CoreProcessClient`; this client holds them and looks like one engine to the
frontend. A request goes to one core, chosen by the router's cache-aware policy
(router/policy.py, the same code `tokenmill router` runs): the core that was sent the prompt's
leading KV blocks (block hashes of its token ids) unless that core's load is too far above the
idlest one's, else the least loaded. Load is this client's count of unfinished requests per core
and each core's last reported running / waiting. Aborts go to the core that owns the request.

Outputs of every core reach the frontend's `on_outputs`; each core's step stats are kept and the
frontend sees their sum (counters, histograms, queue lengths), with `kv_cache_usage` the mean.
Utility calls go to every core (a LoRA adapter is loaded on each) and their stats are merged the
same way. If any core dies or hangs the whole engine is dead (every live request fails, /health
503), as with one core: a supervisor restarts the server; the other cores stop at shutdown.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import AsyncEngineCoreClient
from tokenmill.engine.core_process_client import DEFAULT_HANG_TIMEOUT_S, CoreProcessClient
from tokenmill.engine.messages import EngineCoreRequest, StepOutputs
from tokenmill.errors import EngineDeadError
from tokenmill.router.balancer import LoadBalancer
from tokenmill.router.policy import CacheAwarePolicy, CacheAwareSettings
from tokenmill.router.prefix_index import chained_hashes

# Gauges that are shares of each core's pool: averaged over cores, not summed.
_AVERAGED_STATS = frozenset({"kv_cache_usage"})


def merge_stats(per_core: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One engine's stats from several cores' (see the module docstring)."""
    merged: dict[str, float] = {}
    counts: dict[str, int] = {}
    for stats in per_core:
        for key, value in stats.items():
            merged[key] = merged.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    for key in _AVERAGED_STATS & merged.keys():
        merged[key] /= counts[key]
    return merged


def prompt_block_hashes(request: EngineCoreRequest, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, under a first link for what else keys the
    engine's prefix cache (cache salt, LoRA adapter): prompts that cannot share blocks share no key."""
    ids = request.prompt_token_ids
    lora = request.lora_request.lora_int_id if request.lora_request is not None else None
    blocks = (tuple(ids[i : i + block_size]) for i in range(0, len(ids) - block_size + 1, block_size))
    return chained_hashes([("extra", request.cache_salt, lora), *blocks])[1:]


def core_env(rank: int) -> dict[str, str]:
    """Rank r sees one GPU: the r-th of CUDA_VISIBLE_DEVICES, else device r (no effect on the CPU)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": visible[rank] if rank < len(visible) else str(rank)}


class DataParallelClient(AsyncEngineCoreClient):
    def __init__(
        self,
        config: EngineConfig,
        size: int,
        *,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        policy_settings: CacheAwareSettings | None = None,
        num_api_servers: int = 1,
        cores: list[CoreProcessClient] | None = None,
    ) -> None:
        """`cores`: clients of cores already running (an API server process that did not spawn them,
        `serve --api-server-count`); else this client spawns `size` cores, each answering
        `num_api_servers` API server processes."""
        if size < 2:
            raise ValueError(f"data parallelism needs at least 2 engine cores, got {size}")
        super().__init__()
        self.config = config
        self.info = None
        self.dead = None
        self.cores = cores if cores is not None else [
            CoreProcessClient(config, hang_timeout_s=hang_timeout_s, env=core_env(rank), num_api_servers=num_api_servers)
            for rank in range(size)
        ]  # fmt: skip
        if len(self.cores) != size:
            raise ValueError(f"{size} engine cores, but {len(self.cores)} clients given")
        self.names = [f"core{rank}" for rank in range(size)]
        self.balancer = LoadBalancer(self.names, CacheAwarePolicy(policy_settings))
        self._owner: dict[str, int] = {}  # live request id -> the rank of the core that has it
        self.dispatched = [0] * size  # requests sent to each core so far
        self._core_stats: list[Mapping[str, float]] = [{} for _ in range(size)]
        for rank, core in enumerate(self.cores):
            core.on_outputs = lambda message, rank=rank: self._core_outputs(rank, message)
            core.on_dead = lambda error, rank=rank: self._core_dead(rank, error)
            core.on_api_server_stalled = lambda slot, pid: self.on_api_server_stalled(slot, pid)
            core.num_waiting = lambda rank=rank: self.balancer.load_of(self.names[rank]).in_flight

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def hang_timeout_s(self) -> float:
        return self.cores[0].hang_timeout_s

    @property
    def engine_pid(self) -> int | None:
        return self.cores[0].engine_pid

    @property
    def engine_pids(self) -> list[int | None]:
        return [core.engine_pid for core in self.cores]

    def launch(self, config: EngineConfig) -> None:
        self.config = config
        for core in self.cores:
            core.launch(config)

    async def wait_until_ready(self, ready_timeout_s: float) -> None:
        results = await asyncio.gather(
            *(core.wait_until_ready(ready_timeout_s) for core in self.cores), return_exceptions=True
        )
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise RuntimeError(f"engine core {rank} of {len(self.cores)}: {result}") from result
        # The cores run one config: any one's info describes each (a request fits one core's pool).
        self.info = self.cores[0].info

    def start_loops(self) -> None:
        for core in self.cores:
            core.start_loops()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(core.shutdown(timeout_s) for core in self.cores))

    # -- requests -----------------------------------------------------------------------------

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        assert self.info is not None
        by_rank: dict[int, list[EngineCoreRequest]] = {}
        for request in requests:
            decision = self.balancer.pick(prompt_block_hashes(request, self.info.block_size))
            rank = self.names.index(decision.replica)
            self.balancer.begin(decision.replica)
            self.dispatched[rank] += 1
            self._owner[request.request_id] = rank
            by_rank.setdefault(rank, []).append(request)
        await asyncio.gather(*(self.cores[rank].add_requests(batch) for rank, batch in by_rank.items()))

    def api_server_gone(self, slot: int, pid: int) -> None:
        """Every core hears it: each aborts the requests that process had sent it."""
        for core in self.cores:
            core.api_server_gone(slot, pid)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._release(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.cores[rank].abort_requests(ids)

    def _release(self, request_id: str) -> int | None:
        """Forgets a request's owner (finished or aborted); None if it had none any more."""
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.balancer.end(self.names[rank])
        return rank

    async def call_utility(
        self, method: str, timeout_s: float = 30.0, args: dict[str, str | int | None] | None = None
    ) -> dict[str, float]:
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        results = await asyncio.gather(*(core.call_utility(method, timeout_s, args) for core in self.cores))
        return merge_stats(results)

    # -- what the cores send ------------------------------------------------------------------

    def _core_outputs(self, rank: int, message: StepOutputs) -> None:
        for output in message.outputs:
            if output.finished:
                self._release(output.request_id)
        stats: dict[str, float] = {}
        if message.stats:
            self._core_stats[rank] = message.stats
            self.balancer.set_reported_load(
                self.names[rank], int(message.stats.get("num_running", 0)), int(message.stats.get("num_waiting", 0))
            )
            stats = merge_stats(self._core_stats)
        self.on_outputs(StepOutputs(outputs=message.outputs, stats=stats))

    def _core_dead(self, rank: int, error: EngineDeadError) -> None:
        if self.dead is None:
            self.dead = f"engine core {rank} of {len(self.cores)} is gone: {error}"
        self.on_dead(EngineDeadError(f"the engine is not available: {self.dead}"))

    def mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        for core in self.cores:
            core.mark_dead(reason)
        self.on_dead(EngineDeadError(f"the engine is not available: {self.dead}"))
