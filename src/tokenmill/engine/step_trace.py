"""The engine core's trace (`--trace-dir`): one record per step, one timeline per request.

steps.jsonl gets a line per step once its results are on the host:

  step, start (step() began), scheduled (the schedule was made), launched (the runner returned:
  its kernels are queued, or with synchronous steps done), done (the sampled tokens reached the
  host), tokens, reqs, new_reqs (first scheduled this step), prefill_tokens (tokens of requests
  computing more than one), max_query_len, graph (the CUDA graph's padded size: requests of a
  whole-step decode graph, tokens of piecewise graphs; 0: eager),
  running / waiting after the schedule, compiles ([kernel, start, seconds] of Triton JIT compiles
  during the step's host part), gc ([start, seconds, generation] of collections since the
  previous step)

and each request's `RequestTimeline` (core/request_timeline.py) rides on its final output to the
API server, which logs it to requests.jsonl (engine/request_trace.py). With async scheduling a
step's `launched` comes before the previous step's `done`: the device runs them back to back, so
a step's device time is about done - max(launched, the previous step's done).

`bench serve --server-trace-dir` joins both files with the client's own times (bench/tail.py).

With `--otlp-traces-endpoint` and no `--trace-dir` the tracer keeps only the request timelines
(no steps.jsonl): the API server turns them into OpenTelemetry spans (engine/otel_spans.py).
"""

from __future__ import annotations

import time

import msgspec

from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request_timeline import RequestTimeline
from tokenmill.engine.gc_pauses import GcPauses
from tokenmill.engine.trace_files import STEPS_FILE, open_trace_file

FLUSH_INTERVAL_S = 0.5


class StepRecord(msgspec.Struct):
    step: int
    start: float
    scheduled: float
    tokens: int
    reqs: int
    new_reqs: int
    prefill_tokens: int
    max_query_len: int
    running: int
    waiting: int
    launched: float = 0.0
    done: float = 0.0
    graph: int = 0
    compiles: list[tuple[str, float, float]] = []
    gc: list[tuple[float, float, int]] = []


class StepTracer:
    def __init__(self, trace_dir: str | None) -> None:
        # None: request timelines only (for the OTLP spans), no per-step records.
        self._file = open_trace_file(trace_dir, STEPS_FILE) if trace_dir else None
        self._encoder = msgspec.json.Encoder()
        self._last_flush = time.monotonic()
        self._timelines: dict[str, RequestTimeline] = {}
        self._computed: dict[str, int] = {}  # prompt tokens scheduled so far, per request
        self._records: dict[int, StepRecord] = {}  # id(scheduler output) -> its record, until done
        self._outputs: dict[int, SchedulerOutput] = {}  # keeps those ids unique while pending
        self._num_steps = 0
        self._gc: GcPauses | None = None
        self._compiles = None
        if self._file is not None:
            from tokenmill.kernels.jit_compiles import JitCompiles  # engine side only (Triton)

            self._gc = GcPauses()
            self._compiles = JitCompiles()

    # -- requests -----------------------------------------------------------------------------

    def request_added(self, request_id: str, arrival: float, prompt_tokens: int) -> None:
        self._timelines[request_id] = RequestTimeline(
            arrival=arrival, received=time.monotonic(), prompt_tokens=prompt_tokens
        )
        self._computed[request_id] = 0

    def outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Stamp first tokens and ends; a final output takes its request's timeline along."""
        now = time.monotonic()
        for out in outputs:
            timeline = self._timelines.get(out.request_id)
            if timeline is None:
                continue
            if out.new_token_ids and not timeline.first_token:
                timeline.first_token = now
            if out.finished:
                timeline.finished = now
                out.timeline = self._timelines.pop(out.request_id)
                self._computed.pop(out.request_id, None)

    # -- steps --------------------------------------------------------------------------------

    def scheduled(self, so: SchedulerOutput, start: float, num_running: int, num_waiting: int) -> None:
        now = time.monotonic()
        step = self._num_steps
        self._num_steps += 1
        timelines, computed = self._timelines, self._computed
        for request_id in so.preempted_req_ids:  # they start over (recompute) when they resume
            timeline = timelines.get(request_id)
            if timeline is not None:
                timeline.preempted.append(now)
                computed[request_id] = 0
        for new in so.scheduled_new_reqs:  # a prefix-cache hit starts past the prompt's beginning
            if new.request_id in computed:
                computed[new.request_id] = new.num_computed_tokens
        prefill_tokens = 0
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            if num_tokens > 1:
                prefill_tokens += num_tokens
            timeline = timelines.get(request_id)
            if timeline is None:
                continue
            timeline.num_steps += 1
            done = computed[request_id]
            if done < timeline.prompt_tokens:
                timeline.prefill_chunks.append((now, step, min(num_tokens, timeline.prompt_tokens - done)))
                computed[request_id] = done + num_tokens
        if self._file is None:
            return
        self._records[id(so)] = StepRecord(
            step=step,
            start=start,
            scheduled=now,
            tokens=so.total_num_scheduled_tokens,
            reqs=len(so.num_scheduled_tokens),
            new_reqs=len(so.scheduled_new_reqs),
            prefill_tokens=prefill_tokens,
            max_query_len=max(so.num_scheduled_tokens.values(), default=0),
            running=num_running,
            waiting=num_waiting,
        )
        self._outputs[id(so)] = so

    def launched(self, so: SchedulerOutput) -> None:
        record = self._records.get(id(so))
        if record is not None and self._compiles is not None:
            record.launched = time.monotonic()
            record.compiles = self._compiles.drain()

    def done(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        record = self._records.pop(id(so), None)
        self._outputs.pop(id(so), None)
        if record is None or self._file is None or self._compiles is None or self._gc is None:
            return
        now = time.monotonic()
        if not record.launched:
            record.launched = now
        record.done = now
        record.graph = runner_output.cuda_graph_size
        record.compiles = record.compiles + self._compiles.drain()
        record.gc = self._gc.drain()
        self._file.write(self._encoder.encode(record) + b"\n")
        if now - self._last_flush > FLUSH_INTERVAL_S:
            self.flush()

    def start_serving(self) -> None:
        """Forget the collections and compiles of the start-up after this tracer was made (the core
        process's full collection before it freezes the heap took ~100 ms, and was charged to the
        first step)."""
        if self._gc is not None and self._compiles is not None:
            self._gc.drain()
            self._compiles.drain()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._file is None or self._file.closed:
            return
        self._file.close()
        if self._gc is not None and self._compiles is not None:
            self._gc.close()
            self._compiles.close()
