"""Output throughput while a concurrency-capped run kept the server full.

A finite run at saturation has a ramp (the first `max_concurrency` requests still arriving, decode
batches still small) and a drain (after the last request is sent, nothing refills the seats of the
ones that finish). Both lower the run's overall output tok/s, and an offline run of a few hundred
requests sent at once has neither to the same degree. This reports the part in between: from the
moment `max_concurrency` requests were first in flight to the moment the last request was sent,
the output tokens the client received in that window over its length, and the time-weighted mean
number of requests in flight (at or near the cap if the server really was kept full: the client
refills a seat as soon as a stream ends while requests are waiting).

Token times come from the client's chunk times; a chunk that carries several tokens (the usage
count is above the number of content chunks) has its tokens spread evenly over the request's chunks.
"""

from __future__ import annotations

import numpy as np

from tokenmill.bench.serve_metrics import RequestResult


def _chunk_times(r: RequestResult) -> np.ndarray:
    """perf_counter times of a successful request's content chunks."""
    first = r.start_time + r.ttft
    return first + np.concatenate(([0.0], np.cumsum(np.asarray(r.itl, dtype=np.float64))))


def saturated_window(results: list[RequestResult], max_concurrency: int | None) -> dict[str, float] | None:
    """The window's figures, or None without a cap, or when the cap was never reached before the
    last request was sent (the run never kept the server full)."""
    if not max_concurrency or not results:
        return None
    events: list[tuple[float, int]] = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + max(r.latency, 0.0), -1))
    # At equal times an end comes before a start: a seat refilled at once is not two in flight.
    events.sort(key=lambda e: (e[0], e[1]))
    last_send = max(r.start_time for r in results)
    in_flight = 0
    start = None
    for t, delta in events:
        in_flight += delta
        if in_flight >= max_concurrency:
            start = t
            break
    if start is None or start >= last_send:
        return None
    end = last_send

    # Time-weighted mean in flight over [start, end].
    in_flight, area, prev = 0, 0.0, start
    for t, delta in events:
        if t > start:
            clipped = min(t, end)
            area += in_flight * (clipped - prev)
            prev = clipped
            if t >= end:
                break
        in_flight += delta
    tokens = 0.0
    for r in results:
        if not r.success or r.output_tokens <= 0:
            continue
        times = _chunk_times(r)
        inside = np.count_nonzero((times >= start) & (times < end))
        tokens += inside * r.output_tokens / len(times)
    seconds = end - start
    first_send = min(r.start_time for r in results)
    return {
        "window_start_s": start - first_send,
        "window_end_s": end - first_send,
        "window_seconds": seconds,
        "output_tokens": tokens,
        "output_throughput": tokens / seconds,
        "mean_in_flight": area / seconds,
    }


def format_saturated_window(window: dict[str, float], max_concurrency: int) -> str:
    return (
        f"While full ({window['window_start_s']:.1f}-{window['window_end_s']:.1f} s after the first send, "
        f"mean {window['mean_in_flight']:.1f} of {max_concurrency} in flight): "
        f"{window['output_throughput']:.2f} output tok/s"
    )
