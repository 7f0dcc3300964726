"""Each live request's `RequestTimeline` (core/request_timeline.py), kept by the engine core always
(not only with --trace-dir): its final output carries it to the API server, whose dashboard keeps
the recent ones and shows the slowest (dashboard/recent_requests.py), and whose --trace-dir log
writes them (engine/request_trace.py).

The per-step cost is one dict look-up per scheduled request; the step records of steps.jsonl stay
in the step tracer (engine/step_trace.py), which exists only with --trace-dir.
"""

from __future__ import annotations

import time

from tokenmill.core.outputs import EngineCoreOutput, SchedulerOutput
from tokenmill.core.request_timeline import RequestTimeline


class RequestTimelines:
    def __init__(self) -> None:
        self._timelines: dict[str, RequestTimeline] = {}
        self._computed: dict[str, int] = {}  # prompt tokens scheduled so far, per request
        self._num_steps = 0  # steps scheduled so far: a prefill chunk's step number

    def __len__(self) -> int:
        return len(self._timelines)

    def request_added(self, request_id: str, arrival: float, prompt_tokens: int, priority: int = 0) -> None:
        self._timelines[request_id] = RequestTimeline(
            arrival=arrival, received=time.monotonic(), prompt_tokens=prompt_tokens, priority=priority
        )
        self._computed[request_id] = 0

    def scheduled(self, so: SchedulerOutput, now: float) -> int:
        """Stamp a step's prefill chunks and preemptions; returns the step's number."""
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
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            timeline = timelines.get(request_id)
            if timeline is None:
                continue
            timeline.num_steps += 1
            done = computed[request_id]
            if done < timeline.prompt_tokens:
                timeline.prefill_chunks.append((now, step, min(num_tokens, timeline.prompt_tokens - done)))
                computed[request_id] = done + num_tokens
        return step

    def outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Stamp first tokens, count output tokens and stamp ends; a final output takes its
        request's timeline along (and the engine forgets it)."""
        now = time.monotonic()
        for out in outputs:
            timeline = self._timelines.get(out.request_id)
            if timeline is None:
                continue
            if out.new_token_ids:
                timeline.output_tokens += len(out.new_token_ids)
                if not timeline.first_token:
                    timeline.first_token = now
            if out.finished:
                timeline.finished = now
                out.timeline = self._timelines.pop(out.request_id)
                self._computed.pop(out.request_id, None)
