"""The engine core's trace (`--trace-dir`): one record per step, one timeline per request.

steps.jsonl gets a line per step once its results are on the host:

  step, start (step() began), scheduled (the schedule was made), launched (the runner returned:
  its kernels are queued, or with synchronous steps done), done (the sampled tokens reached the
  host), tokens, reqs, new_reqs (first scheduled this step), prefill_tokens (tokens of requests
  computing more than one), max_query_len, graph (the CUDA graph's padded size: requests of a
  whole-step decode graph, tokens of piecewise graphs; 0: eager),
  running / waiting after the schedule, compiles ([kernel, start, seconds] of Triton JIT compiles
  during the step's host part), gc ([start, seconds, generation] of collections since the
  previous step); for a step with constrained requests also sampled (its masked sampling was
  launched, after its bitmask) and mask_wait (seconds the engine waited for that bitmask's fill)

and each request's `RequestTimeline` (kept always, engine/request_timelines.py) rides on its final
output to the API server, which logs it to requests.jsonl (engine/request_trace.py). With async scheduling a
step's `launched` comes before the previous step's `done`: the device runs them back to back, so
a step's device time is about done - max(launched, the previous step's done).

`bench serve --server-trace-dir` joins both files with the client's own times (bench/tail.py).
"""

from __future__ import annotations

import time

import msgspec

from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
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
    sampled: float = 0.0
    mask_wait: float = 0.0
    graph: int = 0
    compiles: list[tuple[str, float, float]] = []
    gc: list[tuple[float, float, int]] = []


class StepTracer:
    def __init__(self, trace_dir: str) -> None:
        self._file = open_trace_file(trace_dir, STEPS_FILE)
        self._encoder = msgspec.json.Encoder()
        self._last_flush = time.monotonic()
        self._records: dict[int, StepRecord] = {}  # id(scheduler output) -> its record, until done
        self._outputs: dict[int, SchedulerOutput] = {}  # keeps those ids unique while pending
        from tokenmill.kernels.jit_compiles import JitCompiles  # engine side only (Triton)

        self._gc = GcPauses()
        self._compiles = JitCompiles()

    # -- steps --------------------------------------------------------------------------------

    def scheduled(self, so: SchedulerOutput, step: int, start: float, now: float, num_running: int, num_waiting: int) -> None:
        """Open the record of step number `step` (its number from the request timelines)."""
        prefill_tokens = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
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
        if record is not None:
            record.launched = time.monotonic()
            record.compiles = self._compiles.drain()

    def sampled(self, so: SchedulerOutput, mask_wait: float) -> None:
        """A constrained step's masked sampling was launched, after waiting `mask_wait` s for its mask."""
        record = self._records.get(id(so))
        if record is not None:
            record.sampled = time.monotonic()
            record.mask_wait = mask_wait

    def done(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        record = self._records.pop(id(so), None)
        self._outputs.pop(id(so), None)
        if record is None:
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
        self._gc.drain()
        self._compiles.drain()
        self._compiles.start_serving()

    def flush(self) -> None:
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        self._gc.close()
        self._compiles.close()
