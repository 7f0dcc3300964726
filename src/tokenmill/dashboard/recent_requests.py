"""The recent finished requests with their timelines, in a bounded ring: the dashboard's "slowest
recent requests" table and one request's timeline (where its time went: waiting for the engine,
prefill chunks, preemptions, decode, delivery).

Times are `time.monotonic()` seconds (one clock for every process of the host, see
core/request_timeline.py); the page gets them relative to the request's arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request_timeline import RequestTimeline

SORT_KEYS = ("e2e", "ttft", "queue")


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    finish_reason: str | None
    arrival: float
    finished: float  # the API server processed its last output
    timeline: RequestTimeline | None = None  # the engine's; None where none came (an abort here)

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def ttft(self) -> float | None:
        t = self.timeline
        return t.first_token - self.arrival if t is not None and t.first_token else None

    @property
    def queue(self) -> float | None:
        """Arrival to first scheduled (None: never scheduled)."""
        t = self.timeline
        return t.prefill_chunks[0][0] - self.arrival if t is not None and t.prefill_chunks else None

    def summary(self) -> dict[str, Any]:
        t = self.timeline
        return {
            "id": self.request_id,
            "finish_reason": self.finish_reason,
            "e2e": self.e2e,
            "ttft": self.ttft,
            "queue": self.queue,
            "prompt_tokens": t.prompt_tokens if t is not None else None,
            "output_tokens": t.output_tokens if t is not None else None,
            "preemptions": len(t.preempted) if t is not None else 0,
            "steps": t.num_steps if t is not None else None,
        }

    def detail(self) -> dict[str, Any]:
        """The summary plus the timeline: phases [name, start, end] and marks [name, time, note],
        in seconds since arrival."""
        out = self.summary()
        t, at = self.timeline, self.arrival
        phases: list[tuple[str, float, float]] = []
        marks: list[tuple[str, float, str]] = [("arrival", 0.0, "reached the server")]
        if t is not None:
            first_scheduled = t.prefill_chunks[0][0] if t.prefill_chunks else None
            engine_end = t.finished or self.finished
            phases.append(("to engine", 0.0, t.received - at))
            phases.append(("waiting", t.received - at, (first_scheduled or engine_end) - at))
            if first_scheduled is not None:
                prefill_end = t.first_token or engine_end
                phases.append(("prefill", first_scheduled - at, prefill_end - at))
            if t.first_token:
                phases.append(("decode", t.first_token - at, engine_end - at))
                marks.append(("first token", t.first_token - at, ""))
            phases.append(("to client", engine_end - at, self.finished - at))
            for when, step, tokens in t.prefill_chunks:
                marks.append(("prefill chunk", when - at, f"{tokens} tokens in step {step}"))
            for when in t.preempted:
                marks.append(("preempted", when - at, "lost its KV blocks; recomputed later"))
        marks.append(("finished", self.finished - at, self.finish_reason or ""))
        out["phases"] = [{"name": n, "start": s, "end": max(s, e)} for n, s, e in phases]
        out["marks"] = [{"name": n, "t": when, "note": note} for n, when, note in sorted(marks, key=lambda m: m[1])]
        return out


class RecentRequests:
    def __init__(self, capacity: int = 1000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._ring: deque[FinishedRequest] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, request: FinishedRequest) -> None:
        self._ring.append(request)

    def record_output(self, out: EngineCoreOutput, arrival: float, now: float) -> None:
        """A finished engine output (the AsyncEngine's hook): kept with the timeline it carries."""
        self.add(FinishedRequest(out.request_id, out.finish_reason, arrival, now, out.timeline))

    def slowest(self, n: int = 20, by: str = "e2e") -> list[dict[str, Any]]:
        if by not in SORT_KEYS:
            raise ValueError(f"sort by one of {SORT_KEYS}, got {by!r}")
        keyed = [(getattr(r, by), r) for r in self._ring]
        keyed = [(k, r) for k, r in keyed if k is not None]
        keyed.sort(key=lambda kr: kr[0], reverse=True)
        return [r.summary() for _, r in keyed[:n]]

    def get(self, request_id: str) -> FinishedRequest | None:
        for request in reversed(self._ring):
            if request.request_id == request_id:
                return request
        return None
