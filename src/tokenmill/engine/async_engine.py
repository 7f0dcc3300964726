"""The API server's handle on the engine: spawns the engine-core process and streams results.

Tokenization, detokenization and stop strings run here, in the API process, so the engine loop
only schedules and computes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineInfo,
    EngineMessage,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.errors import EngineDeadError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

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


def _spawn_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> subprocess.Popen:
    """Starts `python -m tokenmill.engine.core_process` with the config's msgpack on its stdin.

    A plain subprocess rather than multiprocessing, whose spawn start method pickles the target
    and its arguments over a pipe: here only msgpack and command-line strings cross. The child
    stays in this session and process group (Ctrl-C reaches both; the engine ignores it and
    waits for the server's Shutdown), inherits no file descriptor but stdio (close_fds), so it
    never holds the listening socket, and dies with this process (see core_process).
    Must run on the thread that lives as long as the server: PR_SET_PDEATHSIG fires when the
    creating *thread* exits.
    """
    command = [
        sys.executable, "-m", "tokenmill.engine.core_process",
        "--input-addr", input_addr, "--output-addr", output_addr, "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.PIPE, close_fds=True, start_new_session=False)
    assert process.stdin is not None
    try:
        process.stdin.write(msgspec.msgpack.encode(config))
        process.stdin.close()
    except OSError:  # it died at once; start() reports its exit code
        pass
    return process


def _aborted_output(state: RequestState) -> RequestOutput:
    """The final output of a sequence ended on this side (client gone, drain, timeout): nothing new,
    finish_reason "abort". `state` is the OutputProcessor's RequestState."""
    return RequestOutput(
        request_id=state.parent_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[CompletionOutput(index=state.index, text="", token_ids=[], finish_reason="abort")],
        finished=True,
        num_cached_tokens=state.num_cached_tokens,
        metrics={"arrival_time": state.arrival_time},
    )


@dataclasses.dataclass(slots=True)
class _Stream:
    """Per user request: where its outputs go and which engine sequences belong to it."""

    queue: asyncio.Queue
    child_ids: list[str]
    num_finished: int = 0


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        if hang_timeout_s < 0:
            raise ValueError(f"hang_timeout_s must be >= 0 (0 disables the check), got {hang_timeout_s}")
        self.config = config
        self.hang_timeout_s = hang_timeout_s
        self.last_heard = time.monotonic()  # when the engine process last sent anything
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.stats: dict[str, float] = {}
        self.dead: str | None = None  # why the engine is gone
        self.on_step_stats = None  # callback(stats) for metrics
        self.on_output = None  # callback(RequestOutput, now) for metrics
        self._streams: dict[str, _Stream] = {}
        self._child_to_parent: dict[str, str] = {}
        self._ids = itertools.count()
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._process: subprocess.Popen | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")
        os.chmod(self._ipc_dir, 0o700)  # only this user may reach the sockets
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

    async def start(self, ready_timeout_s: float = 1800.0) -> None:
        from tokenmill.model.resolve import resolve_model

        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._to_engine.bind(input_addr)
        self._from_engine.bind(output_addr)

        # Resolve (and fetch, for the default model) before spawning, so the engine reuses the cache.
        resolved = await asyncio.to_thread(resolve_model, self.config.model)
        self._process = _spawn_engine_process(self.config, input_addr, output_addr)
        # If this process exits without shutdown() (an exception in the caller), kill the engine
        # rather than leave it to notice the parent is gone.
        atexit.register(_kill_if_alive, self._process)
        logger.info("engine process %d started; loading the model", self._process.pid)
        # The tokenizer (importing transformers takes seconds) loads while the engine starts.
        tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, resolved))
        try:
            await self._wait_until_ready(ready_timeout_s)
        except BaseException:
            await asyncio.wait({tokenizer_loaded})  # a thread cannot be cancelled: let it finish
            if not tokenizer_loaded.cancelled():
                tokenizer_loaded.exception()  # the engine's failure is the one to report
            raise
        self.tokenizer, self.eos_token_ids = await tokenizer_loaded
        assert self.info is not None
        self.input_processor = InputProcessor(self.tokenizer, self.info, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]
        logger.info(
            "engine ready: %d KV blocks x %d tokens, max_model_len %d, %s %s",
            self.info.num_kv_blocks, self.info.block_size, self.info.max_model_len, self.info.device, self.info.dtype,
        )  # fmt: skip

    def _load_tokenizer(self, resolved: Any) -> tuple[Any, list[int]]:
        from tokenmill.model.tokenizer import eos_token_ids, load_tokenizer_or_none

        tokenizer = load_tokenizer_or_none(resolved, self.config.model.chat_template)
        # The same EOS set as the offline LLM, so both stop at the same token.
        eos = eos_token_ids(tokenizer, resolved) if tokenizer is not None else resolved.arch.eos_token_ids
        return tokenizer, list(eos)

    async def _wait_until_ready(self, ready_timeout_s: float) -> None:
        assert self._process is not None
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
            if self._process.poll() is not None:  # checked after the poll, so its last words are read
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code {self._process.returncode})"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine was not ready after {ready_timeout_s:.0f} s")

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the engine process (asking first, then SIGKILL) and reaps it."""
        if self._closed:
            return
        self._stopping = True
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._to_engine.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            if not await self._wait_for_exit(timeout_s):  # it ignores SIGTERM (see core_process)
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
                self._process.kill()
                await self._wait_for_exit(5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._mark_dead("the server is shutting down")
        self._closed = True
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._send_ctx.term()
        self._ctx.term()
        for name in ("input", "output"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._ipc_dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._ipc_dir)

    async def _wait_for_exit(self, timeout_s: float) -> bool:
        """Waits (without blocking the loop) for the engine process to exit and reaps it."""
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while self._process.poll() is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- requests -----------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        """User requests (each possibly several engine sequences) not yet fully delivered."""
        return len(self._streams)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{os.urandom(4).hex()}"

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = True,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields per-sequence RequestOutputs (delta text when stream=True) until all n finish.

        Raises InvalidRequestError before anything reaches the engine if the request is bad, and
        EngineDeadError if the engine is gone. Cancelling the iteration (client disconnect)
        aborts the request in the engine.
        """
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert self.input_processor is not None and self.output_processor is not None
        children = []
        for index in range(params.n):
            child_params = (
                params
                if params.n == 1
                else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + index
                )
            )
            child_id = request_id if params.n == 1 else f"{request_id}-{index}"
            children.append(
                (index, self.input_processor.make_request(child_id, prompt_token_ids, child_params, priority=priority, cache_salt=cache_salt))
            )  # fmt: skip
        record = _Stream(queue=asyncio.Queue(), child_ids=[c.request_id for _, c in children])
        self._streams[request_id] = record
        finished_cleanly = False
        try:
            for index, core_req in children:
                self._child_to_parent[core_req.request_id] = request_id
                self.output_processor.add_request(
                    core_req.request_id, request_id, index, prompt, prompt_token_ids, core_req.sampling_params,
                    stream=stream, arrival_time=core_req.arrival_time,
                )  # fmt: skip
            await self._send(AddRequests([c for _, c in children]))
            while record.num_finished < len(record.child_ids):
                item = await record.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    record.num_finished += 1
                yield item
            finished_cleanly = True
        finally:
            if not finished_cleanly:
                self._abort_children(record, deliver=False)
            self._forget(request_id)

    async def abort(self, request_id: str, indexes: Collection[int] | None = None) -> None:
        """Ends a user request now: its unfinished sequences (those of `indexes` among its n, or
        all) get finish_reason "abort", delivered to whoever iterates generate(), and the engine
        frees their blocks at its next step."""
        record = self._streams.get(request_id)
        if record is not None:
            only = None if indexes is None else [record.child_ids[i] for i in indexes]
            self._abort_children(record, deliver=True, only=only)

    async def abort_all(self) -> None:
        """Ends every live request; each client still receives finish_reason "abort"."""
        for record in list(self._streams.values()):
            self._abort_children(record, deliver=True)

    def _abort_children(self, record: _Stream, *, deliver: bool, only: list[str] | None = None) -> None:
        """Drops the live sequences of `record` (or those of them in `only`) here and tells the
        engine. Never suspends, so it also runs to completion inside a cancelled task's clean-up."""
        assert self.output_processor is not None
        now = time.monotonic()
        live = []
        for cid in record.child_ids if only is None else only:
            state = self.output_processor.states.get(cid)
            if state is None:
                continue  # already finished
            live.append(cid)
            self.output_processor.abort_request(cid)
            aborted = _aborted_output(state)
            if self.on_output is not None:
                self._callback(self.on_output, aborted, now)  # metrics: count it, stop its clock
            if deliver:
                record.queue.put_nowait(aborted)
        if live:
            self._send_nowait(AbortRequests(live))

    def _forget(self, request_id: str) -> None:
        record = self._streams.pop(request_id, None)
        if record is not None:
            for cid in record.child_ids:
                self._child_to_parent.pop(cid, None)

    async def call_utility(self, method: str, timeout_s: float = 30.0) -> dict[str, float]:
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            await self._send(UtilityCall(call_id, method))
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

    # -- background tasks ---------------------------------------------------------------------

    async def _output_loop(self) -> None:
        assert self.output_processor is not None
        try:
            while True:
                self._handle_message(self._decoder.decode(await self._from_engine.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging
            logger.exception("output loop failed")
            self._mark_dead(f"output loop failed: {exc}")

    def _handle_message(self, message: Any) -> None:
        """One message from the engine process (it is alive and speaking)."""
        self.last_heard = time.monotonic()
        if isinstance(message, StepOutputs):
            self._handle_outputs(message)
        elif isinstance(message, UtilityResult):
            future = self._utility_calls.get(message.call_id)
            if future is not None and not future.done():
                if message.error:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result or {})

    def _handle_outputs(self, message: StepOutputs) -> None:
        assert self.output_processor is not None
        if message.stats:
            self.stats = message.stats
            if self.on_step_stats is not None:
                self._callback(self.on_step_stats, message.stats)
        if not message.outputs:
            return
        now = time.monotonic()
        to_abort: list[str] = []
        for core_output in message.outputs:
            # One at a time, so a failure (a detokenizer bug, say) ends only its own request. The
            # state is looked up first: the processor forgets a finished sequence before building its
            # last output, and a failure there must still end the sequence for its client.
            state = self.output_processor.states.get(core_output.request_id)
            try:
                processed = self.output_processor.process_outputs([core_output], now)
            except Exception as exc:
                logger.exception("processing the output of %s failed", core_output.request_id)
                if state is not None:
                    self._fail_sequence(state, f"{type(exc).__name__}: {exc}", now)
                if not core_output.finished:
                    to_abort.append(core_output.request_id)
                continue
            to_abort.extend(processed.reqs_to_abort)  # stop strings matched here
            for out in processed.request_outputs:
                self._deliver(out, now)
        if to_abort:
            self._send_nowait(AbortRequests(to_abort))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        if self.on_output is not None:
            self._callback(self.on_output, out, now)
        record = self._streams.get(out.request_id)
        if record is not None:
            record.queue.put_nowait(out)

    def _fail_sequence(self, state: RequestState, reason: str, now: float) -> None:
        """Ends one sequence here with finish_reason "error" (its client gets the reason). `state` is
        its OutputProcessor RequestState, which the processor may already have dropped."""
        assert self.output_processor is not None
        self.output_processor.abort_request(state.request_id)
        failed = _aborted_output(state)
        failed.outputs[0].finish_reason = "error"
        failed.error = f"processing the model's output failed: {reason}"
        self._deliver(failed, now)

    @staticmethod
    def _callback(fn: Any, *args: Any) -> None:
        # Metrics hooks: a bug there is logged, and must not take the output loop (every
        # request) down with it.
        try:
            fn(*args)
        except Exception:
            logger.exception("output callback %r failed", fn)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._process is not None and self._process.poll() is not None:
                if not self._stopping:
                    logger.error("the engine process died (exit code %s)", self._process.returncode)
                self._mark_dead(f"the engine process exited with code {self._process.returncode}")
                return
            if self._is_hung():
                await self._kill_hung_engine()
                return

    def _is_hung(self) -> bool:
        """Silent for longer than the hang timeout while requests (or utility calls) wait on it."""
        if self.hang_timeout_s <= 0 or self._stopping or self.dead is not None:
            return False
        if not self._streams and not self._utility_calls:
            return False  # an idle engine is not waited on; the first request after a hang finds it
        if time.monotonic() - self.last_heard <= self.hang_timeout_s:
            return False
        # Messages already waiting in the socket mean this loop, not the engine, was slow (a long
        # stall of the event loop); the output loop will read them next.
        return not (self._from_engine.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def _kill_hung_engine(self) -> None:
        """A hung engine is handled as a dead one: killed, its requests failed, /health 503."""
        silent_s = time.monotonic() - self.last_heard
        pid = self._process.pid if self._process is not None else None
        logger.error(
            "the engine process (pid %s) sent nothing for %.1f s while %d requests waited on it, longer "
            "than --engine-hang-timeout %g s; killing it",
            pid, silent_s, len(self._streams), self.hang_timeout_s,
        )  # fmt: skip
        self._mark_dead(
            f"the engine process hung: silent for {silent_s:.1f} s, longer than --engine-hang-timeout "
            f"{self.hang_timeout_s:g} s; it was killed"
        )
        if self._process is not None and self._process.poll() is None:
            self._process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
            if not await self._wait_for_exit(5.0):
                logger.error("the hung engine process %s did not exit after SIGKILL", pid)

    def _mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        error = EngineDeadError(f"the engine is not available: {self.dead}")
        for record in list(self._streams.values()):
            record.queue.put_nowait(error)
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
