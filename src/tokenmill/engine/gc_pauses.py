"""Garbage-collection pauses of this process, timed through `gc.callbacks`.

A full collection walks every tracked object: with many live requests (or after `gc.freeze()` was
skipped) it can stall a process for tens of milliseconds, which a step or an SSE stream then
waits out. The step trace records the pauses (engine/step_trace.py).
"""

from __future__ import annotations

import gc
import time
from collections import deque

# Kept until drained; an owner that never drains (an engine dropped without shutdown) holds at most this many.
MAX_KEPT = 10_000


class GcPauses:
    """Collects (start time, seconds, generation) of every collection until `drain()`."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._pauses: deque[tuple[float, float, int]] = deque(maxlen=MAX_KEPT)
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.monotonic()
        elif self._started is not None:
            now = time.monotonic()
            self._pauses.append((self._started, now - self._started, int(info.get("generation", -1))))
            self._started = None

    def drain(self) -> list[tuple[float, float, int]]:
        pauses = list(self._pauses)
        self._pauses.clear()
        return pauses

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
