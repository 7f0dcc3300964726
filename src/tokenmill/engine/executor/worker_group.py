"""An executor of several tensor-parallel workers: the step goes to all, rank 0's tokens come back.

The ZMQ side is the same however the workers run (local processes: multiproc.py; Ray actors:
ray_executor.py): one PUSH socket per worker carries the commands (each step encoded once, the
same bytes to every rank) and one PULL socket takes every worker's replies. Steps are answered in
order, so a launched step's `result()` reads replies until its own arrives (async scheduling may
launch the next step first).

A worker that fails or dies ends the engine: the collectives cannot go on without it, so
waiting raises EngineDeadError, which the engine core does not turn into a failed batch; the
engine process exits and the API server fails every request and answers /health with 503. A rank
that hangs keeps rank 0 inside a collective: the engine stops reporting, and the API server's
--engine-hang-timeout kills the engine process; the workers die with it (the kernel's parent-death
signal for local workers; Ray ends the actors of a driver that is gone).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.runner_facts import RunnerFacts
from tokenmill.cpu_cores import usable_cores
from tokenmill.engine.executor.abstract import Executor, PendingOutput
from tokenmill.engine.executor.worker_messages import (
    DescribeRunner,
    InitKVCache,
    KVCacheReady,
    LoadLoRA,
    LoRALoaded,
    LoRARemoved,
    Released,
    ReleaseMemory,
    RemoveLoRA,
    RunStep,
    SampleStep,
    StepDeferred,
    StepDone,
    StopWorker,
    WorkerFailed,
    WorkerReady,
    WorkerReply,
    WorkerSpec,
)
from tokenmill.errors import EngineDeadError

if TYPE_CHECKING:
    from tokenmill.engine.executor.worker_group_lora import WorkerGroupLoRA
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model.resolve import ResolvedModel

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 100  # while waiting for a reply, how often the workers' liveness is checked
PEER_LOSS_GRACE_S = 2.0  # after a rank's failure, how long to look for a peer that died first


class _PendingReply:
    def __init__(self, executor: WorkerGroupExecutor, step_id: int) -> None:
        self._executor = executor
        self._step_id = step_id

    def result(self) -> ModelRunnerOutput:
        return self._executor._wait_for_step(self._step_id)


class WorkerGroupExecutor(Executor):
    """Subclasses start the workers (`_start_workers`), say whether one is gone (`_dead_worker`)
    and stop them (`_stop_workers`)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int) -> None:
        from tokenmill.model.tensor_parallel import check_tensor_parallel

        super().__init__(config, resolved, max_model_len)
        self.size = config.parallel.tensor_parallel_size
        # Refused here, before any worker starts, with the reason (the workers would only repeat it).
        check_tensor_parallel(resolved.arch, self.size, resolved.quantization)
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._commands: list[zmq.Socket] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._results: dict[int, ModelRunnerOutput] = {}
        self._deferred: set[int] = set()
        self._next_step_id = 0
        self._awaiting_grammar: int | None = None
        self._shut_down = False
        self._dead: str | None = None
        # While _collect waits: the reply type it gathers and what came so far, by rank.
        self._collecting: tuple[type, dict[int, object]] | None = None
        self._lora: WorkerGroupLoRA | None = None  # the scheduler's LoRA hooks (LoRA on)
        try:
            reply_addr = self._bind(self._replies)
            command_addrs = []
            for _ in range(self.size):
                socket = self._ctx.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 0)
                self._commands.append(socket)
                command_addrs.append(self._bind(socket))
            threads = self._torch_threads_per_rank()
            init_method = self._dist_init_method()
            level = logging.getLevelName(logging.getLogger("tokenmill").getEffectiveLevel())
            specs = [
                WorkerSpec(
                    config,
                    rank,
                    self.size,
                    max_model_len,
                    init_method,
                    command_addrs[rank],
                    reply_addr,
                    parent_pid=os.getpid(),
                    torch_threads=threads,
                    log_level=str(level),
                )  # fmt: skip
                for rank in range(self.size)
            ]
            logger.info(
                "tensor parallelism: %d workers (%s), %d torch threads each",
                self.size, type(self).__name__, threads,
            )  # fmt: skip
            self._start_workers(specs)
            ready = self._collect(WorkerReady)
        except BaseException:
            self.shutdown()
            raise
        self._device = ready[0].device
        self._dtype = ready[0].dtype
        if config.lora is not None:
            from tokenmill.engine.executor.worker_group_lora import WorkerGroupLoRA

            self._lora = WorkerGroupLoRA(config.lora, self)

    # -- what a subclass provides ---------------------------------------------------------------

    @abstractmethod
    def _bind(self, socket: zmq.Socket) -> str:
        """Bind `socket` where the workers can reach it; returns the address they connect to."""

    @abstractmethod
    def _dist_init_method(self) -> str:
        """torch.distributed's rendezvous (tcp://host:port) for the group."""

    @abstractmethod
    def _start_workers(self, specs: list[WorkerSpec]) -> None: ...

    @abstractmethod
    def _dead_worker(self, besides: int | None = None) -> str | None:
        """A sentence about a worker that is gone (other than rank `besides`), or None while all live."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """End the workers (after StopWorker was sent): wait briefly, then kill."""

    def _torch_threads_per_rank(self) -> int:
        """The engine process's CPU share split over the ranks (the engine process itself only
        schedules): $OMP_NUM_THREADS if set, else every core but one left to the API server."""
        if "OMP_NUM_THREADS" in os.environ:
            budget = max(1, int(os.environ["OMP_NUM_THREADS"]))
        else:
            cores = usable_cores()
            budget = max(1, cores - 1)
        return max(1, budget // self.size)

    # -- what the engine core needs to know -----------------------------------------------------

    @property
    def device(self) -> str:
        return self._device

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def lora_hooks(self):  # noqa: ANN201 - WorkerGroupLoRA | None
        return self._lora

    def add_lora(self, lora: LoRARequest) -> None:
        if self._lora is None:
            super().add_lora(lora)
        self._lora.add_lora(lora)  # type: ignore[union-attr]

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora is not None and self._lora.remove_lora(lora_int_id)

    def start_lora_load(self, lora: LoRARequest) -> None:
        """Every rank starts loading `lora` into its host cache (its shard of each A / B); each
        answers LoRALoaded when done, which `poll_replies` (or any wait for a step) hands to the
        LoRA hooks."""
        self._send(LoadLoRA(lora))

    def remove_lora_on_ranks(self, lora_int_id: int) -> list[bool]:
        self._send(RemoveLoRA(lora_int_id))
        return [reply.known for reply in self._collect(LoRARemoved)]

    def poll_replies(self, timeout_s: float) -> None:
        """Take the replies that arrive within `timeout_s` (0: those already here) without waiting
        for any in particular: adapter loads' answers; a step's are kept for its result()."""
        deadline = time.monotonic() + timeout_s
        while self._receive_one(max(0, int((deadline - time.monotonic()) * 1000))):
            pass

    # -- life cycle -----------------------------------------------------------------------------

    def initialize_kv_cache(self) -> int:
        """Each rank sizes its own pool and they agree on the smallest (inside the runners)."""
        self._send(InitKVCache())
        counts = {r.rank: r.num_blocks for r in self._collect(KVCacheReady)}
        if len(set(counts.values())) != 1:
            raise RuntimeError(f"the ranks' KV pools differ in size: {counts}")
        return counts[0]

    def describe_runners(self, measure_bandwidth: bool = False) -> list[RunnerFacts]:
        self._send(DescribeRunner(measure_bandwidth))
        return self._collect(RunnerFacts)

    def check_health(self) -> None:
        dead = self._dead or self._dead_worker()
        if dead:
            raise EngineDeadError(dead)

    def release(self) -> None:
        self._send(ReleaseMemory())
        self._collect(Released)

    def __del__(self) -> None:
        # A dropped engine that was never shut down (`del llm`) still ends its workers, which
        # would otherwise hold their devices' memory until this process exits. At interpreter exit
        # the workers see their parent gone and stop by themselves.
        if not getattr(self, "_shut_down", True) and not sys.is_finalizing():
            self.shutdown()

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self._dead is None:
                self._send(StopWorker())
        except (zmq.ZMQError, EngineDeadError):
            pass  # half-made sockets (a failed start-up) or a lost worker: the workers are stopped below
        try:
            self._stop_workers()
        finally:
            for socket in (*self._commands, self._replies):
                socket.close(linger=0)
            self._ctx.term()

    # -- the step -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        pending = self.execute_model_async(scheduler_output)
        if pending is None:
            raise RuntimeError(
                "the step has structured-output requests: run it with execute_model_async() and then "
                "sample_tokens(grammar_output)"
            )
        return pending.result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        step_id = self._new_step_id()
        self._send(RunStep(step_id, scheduler_output))
        if scheduler_output.structured_output_request_ids:
            # Whether the runner waits for a bitmask depends on the batch (a prefill chunk that
            # samples nothing does not): rank 0 says which.
            self._wait_for(lambda: step_id in self._deferred or step_id in self._results)
            if step_id in self._deferred:
                self._deferred.discard(step_id)
                self._awaiting_grammar = step_id
                return None
        return _PendingReply(self, step_id)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        step_id = self._awaiting_grammar
        if step_id is None:
            raise RuntimeError("sample_tokens() without a step waiting for its grammar bitmask")
        self._awaiting_grammar = None
        self._send(SampleStep(step_id, grammar_output))
        return _PendingReply(self, step_id)

    # -- the sockets ----------------------------------------------------------------------------

    def _new_step_id(self) -> int:
        self._next_step_id += 1
        return self._next_step_id

    def _send(self, command: object) -> None:
        self._check_alive()
        data = self._encoder.encode(command)
        for socket in self._commands:
            # A PUSH socket whose worker is gone blocks a plain send forever: wait only while it lives.
            while True:
                try:
                    socket.send(data, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    dead = self._dead_worker()
                    if dead:
                        self._declare_dead(dead)
                    time.sleep(0.001)

    def _wait_for_step(self, step_id: int) -> ModelRunnerOutput:
        self._wait_for(lambda: step_id in self._results)
        return self._results.pop(step_id)

    def _collect(self, kind: type) -> list:
        """One reply of type `kind` from every rank, in rank order."""
        got: dict[int, object] = {}
        self._collecting = (kind, got)
        try:
            self._wait_for(lambda: len(got) == self.size)
        finally:
            self._collecting = None
        return [got[rank] for rank in range(self.size)]

    def _wait_for(self, done: Callable[[], bool]) -> None:
        """Receive replies until `done()`; raises EngineDeadError when a worker fails or dies."""
        while not done():
            self._receive_one(LIVENESS_POLL_MS)

    def _receive_one(self, wait_ms: int) -> bool:
        """Dispatch one reply that arrives within `wait_ms`; False when none did. Raises
        EngineDeadError when a worker failed or died."""
        self._check_alive()
        if not self._replies.poll(wait_ms):
            dead = self._dead_worker()
            if dead:
                self._declare_dead(dead)
            return False
        self._dispatch(self._decoder.decode(self._replies.recv()))
        return True

    def _dispatch(self, reply: WorkerReply) -> None:
        if isinstance(reply, StepDone):
            self._results[reply.step_id] = reply.output
        elif isinstance(reply, StepDeferred):
            self._deferred.add(reply.step_id)
        elif isinstance(reply, WorkerFailed):
            self._rank_failed(reply)
        elif isinstance(reply, LoRALoaded) and self._lora is not None:
            self._lora.on_loaded(reply)
        elif self._collecting is not None and isinstance(reply, self._collecting[0]):
            self._collecting[1][reply.rank] = reply  # type: ignore[union-attr]
        else:
            logger.warning("ignoring an unexpected %s from a worker", type(reply).__name__)

    def _rank_failed(self, reply: WorkerFailed) -> None:
        """A rank's own failure is often a lost peer seen from a collective (gloo's "connection
        reset"): name the rank that is gone first, when one is (its loss may take a moment to show)."""
        logger.error("tensor-parallel rank %d failed:\n%s", reply.rank, reply.error)
        summary = reply.error.splitlines()[0] if reply.error else "no reason given"
        deadline = time.monotonic() + PEER_LOSS_GRACE_S
        while (dead := self._dead_worker(besides=reply.rank)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead is not None:
            self._declare_dead(f"{dead} (rank {reply.rank} then failed: {summary[:300]})")
        self._declare_dead(f"tensor-parallel rank {reply.rank} failed: {summary[:500]}")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _declare_dead(self, reason: str) -> None:
        logger.error("%s; the engine cannot go on without every rank", reason)
        self._dead = reason
        raise EngineDeadError(reason)
