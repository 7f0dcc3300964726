"""The engine core: schedule -> execute -> sample -> update, one step at a time.

With async scheduling (on by default on CUDA) a step launches the next batch before it waits
for the previous one's sampled tokens: scheduling, batch building and the host side of the
previous step's results all happen while the device computes, so it never waits for Python.
Requests whose sampling needs every earlier token on the host (penalties, min_tokens) or that
ask for prompt logprobs make the engine wait for the previous step before scheduling.

Structured output: grammars compile on the manager's thread pool while their requests wait (the
scheduler skips them); a step with constrained requests runs in two phases, the runner launching
the forward and logits, the manager filling the grammar bitmask on the host meanwhile, then the
runner masking and sampling (`_launch_constrained`). With async scheduling the previous step's
tokens are applied between the two (they advance the grammars the mask is filled from), so
constrained steps overlap like any other.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tokenmill.args import resolve_device_defaults
from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.kv_connector_factory import make_kv_connector
from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.executor import Executor, PendingOutput
from tokenmill.engine.messages import EngineCoreRequest, EngineInfo
from tokenmill.engine.request_timelines import RequestTimelines
from tokenmill.engine.step_trace import StepTracer
from tokenmill.engine.structured_output import StructuredOutputManager
from tokenmill.errors import EngineDeadError
from tokenmill.lora.request import LoRARequest
from tokenmill.model.resolve import ResolvedModel, resolve_model
from tokenmill.stats_histogram import StatsHistogram

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's limit of {model_limit} positions "
            "(max_position_embeddings); pass a value <= that"
        )
    return requested


def _tokenizer_loader(resolved: ResolvedModel, chat_template: str | None) -> Callable[[], Any]:
    """Loads the model's tokenizer (or None) when called: the structured-output manager's."""

    def load():  # noqa: ANN202 - a transformers tokenizer, or None
        from tokenmill.model.tokenizer import load_tokenizer_or_none

        return load_tokenizer_or_none(resolved, chat_template)

    return load


# Powers of two: a decode step of one request up to the largest prefill chunks.
ITERATION_TOKENS_BUCKETS = tuple(float(2**i) for i in range(15))


class EngineCore:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None) -> None:
        # The API server leaves the device and its defaults unresolved (it has no torch).
        unresolved = config
        # First: a --trace-dir that cannot be written is refused before the model loads.
        self.tracer = StepTracer(config.trace_dir) if config.trace_dir else None
        self.timelines = RequestTimelines()  # always: the dashboard shows the slowest requests
        # Tokens per step (vLLM's iteration_tokens_total), counted here and exported by the API server.
        self.iteration_tokens = StatsHistogram("iteration_tokens_total", ITERATION_TOKENS_BUCKETS)
        config = resolve_device_defaults(config)
        if config != unresolved:
            logger.info(
                "engine core: device=%s, max_num_batched_tokens=%d, max_prefill_tokens_while_decoding=%d, "
                "prefill_step_target_ms=%g, async_scheduling=%s",
                config.device, config.scheduler.max_num_batched_tokens,
                config.scheduler.max_prefill_tokens_while_decoding, config.scheduler.prefill_step_target_ms,
                config.async_scheduling,
            )  # fmt: skip
        self.resolved = resolved if resolved is not None else resolve_model(config.model)
        arch = self.resolved.arch
        max_model_len = resolve_max_model_len(config.model.max_model_len, arch.max_position_embeddings)
        self.executor: Executor = Executor.get_class(config)(config, self.resolved, max_model_len)
        num_blocks = self.executor.initialize_kv_cache()
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        # Builds nothing until the first constrained request or `warm_up()` (`serve` calls it at
        # start-up; then the tokenizer and xgrammar, on a compile thread).
        # The loader closes over the model only, not `self`: a bound method here would put the
        # engine in a reference cycle (engine -> manager -> engine), so a dropped engine would keep
        # its KV pool and weights until a full garbage collection.
        self.structured_output = StructuredOutputManager(
            _tokenizer_loader(self.resolved, config.model.chat_template), arch.vocab_size
        )
        # The same plan the model runner built from the same inputs: layers grouped by attention type.
        kv_cache_groups = plan_kv_cache_groups(arch.num_layers, arch.sliding_windows, max_model_len)
        speculative = config.speculative
        self.scheduler = Scheduler(
            self.scheduler_config,
            config.cache,
            num_blocks,
            structured_output=self.structured_output,
            kv_cache_groups=kv_cache_groups,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
            num_lookahead_tokens=self.executor.num_lookahead_tokens,
            lora=self.executor.lora_hooks,
            kv_connector=(
                make_kv_connector(config.cache, self.executor.kv_bytes_per_block, self.executor.kv_layout)
                if config.cache.kv_offload_gb or config.cache.kv_role
                else None
            ),
        )
        self.config = config
        self.info = EngineInfo(
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=config.cache.block_size,
            vocab_size=arch.vocab_size,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            device=self.executor.device,
            dtype=self.executor.dtype,
            kv_capacity_tokens=kv_cache_groups.capacity_tokens(
                num_blocks,
                config.cache.block_size,
                min(self.scheduler_config.max_num_batched_tokens, max_model_len),
                max_model_len,
            ),
        )
        capacity = self.info.kv_capacity_tokens or num_blocks * config.cache.block_size
        logger.info(
            "KV cache holds %d tokens: maximum concurrency for %d tokens per request (max_model_len): %.2fx",
            capacity, max_model_len, capacity / max_model_len,
        )  # fmt: skip
        self._pending: list[EngineCoreOutput] = []  # outputs produced between steps (aborts)
        self.async_scheduling = bool(config.async_scheduling)  # resolved above
        # Speculative decoding: drafts follow a request's last token, which must be on the host when
        # they are scheduled, so steps do not overlap while requests draft.
        self._speculative = speculative is not None
        self._drafts_pending = False  # the last step's results proposed drafts
        # The launched step whose results the host has not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        # A constrained step (async scheduling) whose forward is launched and whose mask is being
        # filled on the manager's thread; sampled before the next launch (`_sample_filled`).
        self._filling: tuple[SchedulerOutput, Future] | None = None
        self._needs_history: set[str] = set()  # live requests that rule out overlapping steps
        self._queue_times: dict[str, float] = {}  # first-scheduled delay, until the first output carries it
        self._reported_queue_time: set[str] = set()
        self._shut_down = False
        # What start-up compiled and collected is not charged to the first step.
        self.start_serving()

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_ids=tuple(req.eos_token_ids),
            arrival_time=req.arrival_time or time.monotonic(),
            priority=req.priority,
            cache_salt=req.cache_salt,
            max_tokens=req.max_tokens,
            lora_request=req.lora_request,
        )
        self.scheduler.add_request(request)
        self.timelines.request_added(
            req.request_id, request.arrival_time, len(req.prompt_token_ids), request.priority
        )
        if req.sampling_params.needs_host_history:
            self._needs_history.add(req.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._pending.extend(self.scheduler.abort_requests(list(request_ids)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        return (
            bool(self._pending)
            or self._in_flight is not None
            or self._filling is not None
            or self.scheduler.has_unfinished_requests()
            or self.scheduler.has_pending_kv_work()
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        # The last step's results proposed drafts: this step must see them, so it waits for the step
        # in flight instead of overlapping it. A batch that drafts nothing (too large, or its
        # drafts keep failing) overlaps its steps as without speculation.
        speculating = self._drafts_pending
        if (self._needs_history or speculating) and (self._in_flight is not None or self._filling is not None):
            outputs.extend(self._sample_filled())
            outputs.extend(self._finish_in_flight())
        scheduler_output = self.scheduler.schedule()
        # The previous constrained step samples now, after this schedule ran beside its mask fill.
        outputs.extend(self._sample_filled())
        if scheduler_output.is_empty:
            if (
                scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
                or scheduler_output.kv_connector_metadata is not None
            ):
                self.executor.execute_model(scheduler_output)  # lets the runner drop those requests' state
            outputs.extend(self._finish_in_flight())
            # Requests the scheduler ended itself (e.g. can never fit) report through here.
            outputs.extend(self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput()))
            if not outputs and self.scheduler.waiting_for_grammar:
                # Nothing to run until a grammar compiles: wait for it rather than spin.
                self.structured_output.wait_for_compiles(timeout=0.005)
            connector = self.scheduler.kv_connector
            if not outputs and connector is not None and self.scheduler.num_waiting:
                # Nothing to run until a transfer arrives: wait for it rather than spin.
                connector.wait_for_arrivals(0.005)
            lora = self.scheduler.lora
            if not outputs and lora is not None and self.scheduler.num_waiting:
                # Nothing to run until an adapter loads: wait for it rather than spin.
                lora.wait_for_loads(timeout=0.005)
            return self._annotate(outputs)
        now = time.monotonic()
        step_number = self.timelines.scheduled(scheduler_output, now)
        self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        if self.tracer is not None:
            self.tracer.scheduled(
                scheduler_output, step_number, started, now, self.scheduler.num_running, self.scheduler.num_waiting
            )
        requests = self.scheduler.requests
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.request_id
            if rid not in self._queue_times and rid not in self._reported_queue_time:
                self._queue_times[rid] = max(0.0, now - requests[rid].arrival_time)
        if self.async_scheduling and not speculating and not scheduler_output.scheduled_spec_decode_tokens:
            pending = self._launch(scheduler_output)
            if isinstance(pending, ModelRunnerOutput):  # the launch failed: its requests end now
                outputs.extend(self._finish_in_flight())
                outputs.extend(self._update(scheduler_output, pending))
                return self._annotate(outputs)
            if self.tracer is not None:
                self.tracer.launched(scheduler_output)
            self.scheduler.launched(scheduler_output)
            if pending is None:  # its rows fill as the tokens below are accepted
                self.structured_output.prepare_fill(scheduler_output)
            # Computed while this step was prepared. For a constrained step (its forward launched,
            # its sampling waiting for the mask) this also advances the grammars by the previous
            # step's tokens, which this step's mask must follow.
            outputs.extend(self._finish_in_flight())
            if pending is None:
                # Its mask fills on the manager's thread while this returns the outputs and the next
                # step is scheduled; the next step() samples it before launching anything.
                self._filling = (scheduler_output, self.structured_output.grammar_output_async(scheduler_output))
                return self._annotate(outputs)
            self._in_flight = (scheduler_output, pending)
            return self._annotate(outputs)
        # One step at a time (no async scheduling, or drafting): whatever is still in flight first.
        outputs.extend(self._sample_filled())
        outputs.extend(self._finish_in_flight())
        try:
            if scheduler_output.structured_output_request_ids:
                runner_output = self._launch_constrained(scheduler_output).result()
            else:
                runner_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:  # the batch failed as a whole: end its requests, keep serving
            runner_output = self._failed_step(scheduler_output, exc)
        outputs.extend(self._update(scheduler_output, runner_output))
        return self._annotate(outputs)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's results (its record is traced as done now)."""
        if self.tracer is not None:
            self.tracer.done(scheduler_output, runner_output)
        if self._speculative:
            self._drafts_pending = bool(runner_output.spec_token_ids)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _launch(self, scheduler_output: SchedulerOutput) -> PendingOutput | ModelRunnerOutput | None:
        """Launch a step (async scheduling). None: a constrained step whose forward is launched and
        whose sampling waits for `_sample_constrained` (after the previous step's tokens)."""
        try:
            pending = self.executor.execute_model_async(scheduler_output)
        except Exception as exc:  # the batch failed as a whole: end its requests, keep serving
            return self._failed_step(scheduler_output, exc)
        assert pending is not None or scheduler_output.structured_output_request_ids, (
            "only a step with constrained requests waits for a bitmask"
        )
        return pending

    def _sample_filled(self) -> list[EngineCoreOutput]:
        """Sample the constrained step whose mask was filling: it becomes the step in flight (its
        forward ran meanwhile). Outputs only if it failed."""
        if self._filling is None:
            return []
        scheduler_output, future = self._filling
        self._filling = None
        waiting = time.monotonic()
        try:
            grammar_output = future.result()
            mask_wait = time.monotonic() - waiting
            pending = self.executor.sample_tokens(grammar_output)
        except Exception as exc:
            return self._update(scheduler_output, self._failed_step(scheduler_output, exc))
        if self.tracer is not None:
            self.tracer.sampled(scheduler_output, mask_wait)
        self._in_flight = (scheduler_output, pending)
        return []

    def _launch_constrained(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch the forward, fill the grammar bitmask while the device runs it, then sample."""
        pending = self.executor.execute_model_async(scheduler_output)
        if pending is not None:  # nothing waited for a mask (no request sampled)
            return pending
        filling = time.monotonic()
        grammar_output = self.structured_output.grammar_output(scheduler_output)
        mask_wait = time.monotonic() - filling
        pending = self.executor.sample_tokens(grammar_output)
        if self.tracer is not None:
            self.tracer.sampled(scheduler_output, mask_wait)
        return pending

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the launched step's sampled tokens and apply them."""
        if self._in_flight is None:
            return []
        scheduler_output, pending = self._in_flight
        self._in_flight = None
        try:
            runner_output = pending.result()
        except Exception as exc:
            runner_output = self._failed_step(scheduler_output, exc)
        return self._update(scheduler_output, runner_output)

    def _failed_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
        if isinstance(exc, EngineDeadError):
            # A lost worker (tensor parallelism) is no batch's fault: the engine cannot go on.
            raise exc
        self.scheduler.step_failed(scheduler_output)
        request_ids = scheduler_output.num_scheduled_tokens
        logger.exception("model step failed; ending the %d requests in it", len(request_ids))
        reason = f"model execution failed: {type(exc).__name__}: {exc}"
        return ModelRunnerOutput(errored=dict.fromkeys(request_ids, reason))

    def _annotate(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Attach each request's queue time to its first output and its timeline to its last;
        forget ended requests. A KV connector's work that need not wait for a step (a producer's
        sends of the requests that just ended) runs first, so a client that reads a request's
        final output knows its blocks are on their way."""
        flush = self.scheduler.take_kv_connector_flush()
        if flush is not None:
            self.executor.run_kv_connector(flush)
        self.timelines.outputs(outputs)
        for out in outputs:
            queue_time = self._queue_times.pop(out.request_id, None)
            if queue_time is not None:
                out.queue_time = queue_time
                if not out.finished:
                    self._reported_queue_time.add(out.request_id)
            if out.finished:
                self._reported_queue_time.discard(out.request_id)
                self._needs_history.discard(out.request_id)
        return outputs

    @property
    def runner(self) -> ModelRunner:
        """The model runner of a one-process executor (benchmarks and tests reach the model through
        it); an executor of several workers has no single runner."""
        return self.executor.driver_runner  # type: ignore[attr-defined]

    def start_serving(self) -> None:
        """Start-up is over (the process may have collected and frozen its heap): what the trace
        records from here on belongs to requests."""
        if self.tracer is not None:
            self.tracer.start_serving()

    def flush_trace(self) -> None:
        if self.tracer is not None:
            self.tracer.flush()

    def shutdown(self) -> None:
        """Frees the devices and ends the workers; idempotent (LLM.close may follow an explicit call)."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.tracer is not None:
            self.tracer.close()
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.close()

    def fail_request(self, request_id: str, message: str) -> None:
        self._pending.extend(
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, error=message)
        )

    def add_lora(self, lora: LoRARequest) -> None:
        """Start loading an adapter (requests naming it wait until it is in host memory)."""
        self.executor.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter. Its prefix-cache blocks are unreachable from then on: a new load gets a
        new id, which is in every block hash of its requests."""
        return self.executor.remove_lora(lora_int_id)

    def get_stats(self) -> dict[str, float]:
        return self.scheduler.get_stats() | self.structured_output.get_stats() | self.iteration_tokens.stats()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
