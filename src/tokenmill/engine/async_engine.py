"""The API server's frontend: request streams over an engine-core client.

Tokenization, n > 1 fan-out, detokenization and stop strings run here, in the API process, so the
engine loop only schedules and computes. Where the engine runs and how it is reached (its process,
sockets, watchdog) is the client's business (core_process_client.CoreProcessClient by default); the
offline LLM uses the same fan-out and output processing over an in-process client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import AsyncEngineCoreClient
from tokenmill.engine.core_process_client import DEFAULT_HANG_TIMEOUT_S, CoreProcessClient
from tokenmill.engine.fanout import fan_out
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.messages import EngineInfo, StepOutputs
from tokenmill.engine.otel_spans import RequestSpans, TraceContext
from tokenmill.engine.output_merge import merge_delta, take_waiting
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.engine.request_log import RequestLog
from tokenmill.engine.request_trace import RequestTraceLog
from tokenmill.engine.stats_log import StatsLog
from tokenmill.errors import EngineDeadError
from tokenmill.lora.request import LoRARequest
from tokenmill.model.arch import ArchConfig
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["DEFAULT_HANG_TIMEOUT_S", "AsyncEngine"]

logger = logging.getLogger(__name__)


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
    def __init__(
        self,
        config: EngineConfig,
        *,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        client: AsyncEngineCoreClient | None = None,
    ) -> None:
        self.config = config
        # First: a --trace-dir that cannot be written is refused before any socket or process exists.
        self._trace = RequestTraceLog(config.trace_dir) if config.trace_dir else None
        # --otlp-traces-endpoint: one OpenTelemetry span per sequence (None: off, nothing imported).
        self.spans: RequestSpans | None = (
            RequestSpans(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
        )
        self.request_log: RequestLog | None = None  # --enable-log-requests (the server sets it)
        self.stats_log: StatsLog | None = None  # the periodic stats line (the server sets it)
        self.client = (
            client if client is not None else CoreProcessClient(config, hang_timeout_s=hang_timeout_s)
        )
        self.client.on_outputs = self._handle_outputs
        self.client.on_dead = self._fail_streams
        self.client.num_waiting = lambda: len(self._streams)
        self.info: EngineInfo | None = None
        self.arch: ArchConfig | None = None  # the model's shapes, once start() resolved it (LoRA checks)
        self.tokenizer: Any = None
        # The model's sampling defaults (--generation-config), for fields a request leaves unset.
        self.default_sampling: dict[str, Any] = {}
        self.eos_token_ids: list[int] = []
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.stats: dict[str, float] = {}
        self.on_step_stats = None  # callback(stats) for metrics
        self.on_output = None  # callback(RequestOutput, now) for metrics
        # callback(EngineCoreOutput, arrival, now) for each finished engine sequence, with the
        # RequestTimeline it carries: the dashboard's recent requests.
        self.on_finished_sequence = None
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self, ready_timeout_s: float = 1800.0) -> None:
        from tokenmill.model.resolve import pin_snapshots, resolve_model

        # Resolve (and fetch, for the default model and Hub ids) before spawning, so the engine
        # reuses the cache; Hub revisions are pinned to the commits found here, so the engine
        # process loads the very snapshot this process reads the tokenizer from.
        resolved = await asyncio.to_thread(resolve_model, self.config.model)
        self.arch = resolved.arch
        self.config = dataclasses.replace(self.config, model=pin_snapshots(self.config.model, resolved))
        from tokenmill.model.generation_defaults import generation_defaults

        self.default_sampling = generation_defaults(self.config.model, resolved)
        self.client.launch(self.config)
        # The tokenizer (importing transformers takes a while) loads while the engine starts.
        tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, resolved))
        try:
            await self.client.wait_until_ready(ready_timeout_s)
        except BaseException:
            await asyncio.wait({tokenizer_loaded})  # a thread cannot be cancelled: let it finish
            if not tokenizer_loaded.cancelled():
                tokenizer_loaded.exception()  # the engine's failure is the one to report
            raise
        self.tokenizer, self.eos_token_ids = await tokenizer_loaded
        self.info = self.client.info
        assert self.info is not None
        self.input_processor = InputProcessor(self.tokenizer, self.info, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client.start_loops()
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

    @property
    def engine_pid(self) -> int | None:
        return self.client.engine_pid

    @property
    def dead(self) -> str | None:
        """Why the engine is gone; None while it serves."""
        return self.client.dead

    @property
    def hang_timeout_s(self) -> float:
        return self.client.hang_timeout_s

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the engine (asking first, then SIGKILL); every live request gets EngineDeadError."""
        await self.client.shutdown(timeout_s)
        if self._trace is not None:
            self._trace.close()
        if self.spans is not None:
            await asyncio.to_thread(self.spans.shutdown)

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
        lora_request: LoRARequest | None = None,
        trace: TraceContext | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields per-sequence RequestOutputs (delta text when stream=True) until all n finish.

        Raises InvalidRequestError before anything reaches the engine if the request is bad, and
        EngineDeadError if the engine is gone. Cancelling the iteration (client disconnect)
        aborts the request in the engine. `trace`: the HTTP request's trace context, for its span.
        `arrival_time`: when the request reached the server (time.monotonic(); None: now), the
        engine request's arrival_time: its TTFT, queue time and SLO deadline count from it, so the
        API server passes the time its HTTP request reached the route, before parsing and tokenizing.
        """
        if self.dead:
            raise EngineDeadError(f"the engine is not available: {self.dead}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert self.input_processor is not None and self.output_processor is not None
        tokenized = time.monotonic()  # the prompt is tokens by now: the span's "tokenized" stage
        if arrival_time is None:
            arrival_time = tokenized
        children = [
            (child.index, self.input_processor.make_request(child.request_id, prompt_token_ids, child.params, priority=priority, cache_salt=cache_salt, arrival_time=arrival_time, lora_request=lora_request))
            for child in fan_out(request_id, params)
        ]  # fmt: skip
        record = _Stream(queue=asyncio.Queue(), child_ids=[c.request_id for _, c in children])
        self._streams[request_id] = record
        finished_cleanly = False
        generated: dict[int, int] = {}  # tokens per sequence index, for the request log
        try:
            for index, core_req in children:
                self.output_processor.add_request(
                    core_req.request_id, request_id, index, prompt, prompt_token_ids, core_req.sampling_params,
                    stream=stream, arrival_time=core_req.arrival_time,
                )  # fmt: skip
                if self.spans is not None:
                    self.spans.add(
                        core_req.request_id, request_id, index, core_req.sampling_params,
                        len(prompt_token_ids), tokenized, trace, n=params.n,
                    )  # fmt: skip
            if self.request_log is not None:
                self.request_log.arrived(request_id, prompt, prompt_token_ids, params, lora_request)
            await self.client.add_requests([c for _, c in children])
            while record.num_finished < len(record.child_ids):
                first = await record.queue.get()
                # A stream's deltas that waited here together (its consumer ran later than they
                # came) go on merged, one per sequence: one SSE chunk instead of several.
                for item in take_waiting(record.queue, first, _delta_key, merge_delta) if stream else (first,):
                    if isinstance(item, BaseException):
                        raise item
                    if self.request_log is not None:
                        index, new_tokens = item.outputs[0].index, len(item.outputs[0].token_ids)
                        # Streamed outputs carry only the new tokens; the others all so far.
                        generated[index] = generated.get(index, 0) + new_tokens if stream else new_tokens
                    if item.finished:
                        record.num_finished += 1
                        if self.request_log is not None:
                            self.request_log.finished(item, generated.get(item.outputs[0].index, 0))
                    yield item
            finished_cleanly = True
        finally:
            if not finished_cleanly:
                self._abort_children(record, deliver=False)
                if self.request_log is not None:
                    self.request_log.abandoned(request_id, record.num_finished, len(record.child_ids))
            self._streams.pop(request_id, None)

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
            self.client.abort_requests(live)

    async def call_utility(
        self, method: str, timeout_s: float = 30.0, args: dict[str, str | int | None] | None = None
    ) -> dict[str, float]:
        return await self.client.call_utility(method, timeout_s, args)

    # -- what the engine sends ----------------------------------------------------------------

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
            if self._trace is not None:
                self._trace.output(core_output, now)
            if self.spans is not None:
                self._callback(self.spans.output, core_output, now)
            # One at a time, so a failure (a detokenizer bug, say) ends only its own request. The
            # state is looked up first: the processor forgets a finished sequence before building its
            # last output, and a failure there must still end the sequence for its client.
            state = self.output_processor.states.get(core_output.request_id)
            if self.stats_log is not None and state is not None:
                self.stats_log.output(core_output, len(state.prompt_token_ids))
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
            if core_output.finished and self.on_finished_sequence is not None:
                timeline = core_output.timeline
                arrival = timeline.arrival if timeline is not None else state.arrival_time if state is not None else now
                self._callback(self.on_finished_sequence, core_output, arrival, now)
        if to_abort:
            self.client.abort_requests(to_abort)

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

    def _fail_streams(self, error: EngineDeadError) -> None:
        """The engine is gone: every live request ends with `error`."""
        if self.spans is not None:
            self._callback(self.spans.fail_all, str(error))
        for record in list(self._streams.values()):
            record.queue.put_nowait(error)

    @staticmethod
    def _callback(fn: Any, *args: Any) -> None:
        # Metrics and tracing hooks: a bug there is logged, and must not take the output loop (every
        # request) down with it.
        try:
            fn(*args)
        except Exception:
            logger.exception("output callback %r failed", fn)


def _delta_key(item: RequestOutput | BaseException) -> tuple[int, bool] | None:
    """take_waiting's key for one request's stream: (its sequence index, finished); None for an
    error, which never merges."""
    if isinstance(item, BaseException):
        return None
    return item.outputs[0].index, item.finished
