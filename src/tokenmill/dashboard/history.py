"""The dashboard's time series: a snapshot of the metrics every `interval_s`, and per snapshot one
point computed over the last `window_s` (percentiles of what the histograms observed in it, rates,
ratios); both kept in bounded rings, so memory stays flat however long the server runs.

Metric names are vLLM's (without the prefix): the page reads any server that exports them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokenmill.dashboard.snapshot import MetricsSnapshot, MetricsSource, take_snapshot
from tokenmill.dashboard.window import (
    cost_per_million_tokens,
    histogram_delta,
    histogram_quantile,
    increase,
    rate,
    ratio,
)

# Latency histograms charted as p50 and p99: the point's key -> the histogram's name.
LATENCY_HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "tpot": "request_time_per_output_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
    "queue": "request_queue_time_seconds",
}
QUANTILES = {"p50": 0.5, "p99": 0.99}
# Counters the page shows as totals, which must equal /metrics at the same moment.
TOTALS = {
    "requests_finished": "request_success_total",
    "prompt_tokens": "prompt_tokens_total",
    "output_tokens": "generation_tokens_total",
    "preemptions": "num_preemptions_total",
    "rejections": "request_rejected_total",
}


class MetricsHistory:
    def __init__(
        self,
        source: MetricsSource,
        prefix: str,
        *,
        interval_s: float = 1.0,
        window_s: float = 10.0,
        capacity: int = 3600,
        cost_per_hour: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s} and {window_s}")
        self.source = source
        self.prefix = prefix
        self.interval_s = interval_s
        self.window_s = window_s
        self.cost_per_hour = cost_per_hour
        self._clock = clock
        self._wall_clock = wall_clock
        # Enough snapshots to span a window, and the points (one per snapshot after the first).
        self._snapshots: deque[MetricsSnapshot] = deque(maxlen=int(window_s / interval_s) + 2)
        self.points: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.started = clock()
        self.first: MetricsSnapshot | None = None

    @property
    def latest(self) -> MetricsSnapshot | None:
        return self._snapshots[-1] if self._snapshots else None

    def maybe_sample(self) -> bool:
        """Take a snapshot when `interval_s` passed since the last one (cheap to call often)."""
        latest = self.latest
        if latest is not None and self._clock() - latest.time < self.interval_s:
            return False
        self.sample()
        return True

    def sample(self) -> MetricsSnapshot:
        snapshot = take_snapshot(self.source(), self.prefix, self._clock(), self._wall_clock())
        if self.first is None:
            self.first = snapshot
        base = self._window_start(snapshot.time)
        self._snapshots.append(snapshot)
        if base is not None:
            self.points.append(point(snapshot, base, self.cost_per_hour))
        return snapshot

    def _window_start(self, now: float) -> MetricsSnapshot | None:
        """The oldest kept snapshot no more than `window_s` before `now` (else the newest one)."""
        for snapshot in self._snapshots:
            if now - snapshot.time <= self.window_s + 1e-9:
                return snapshot
        return self._snapshots[-1] if self._snapshots else None

    def points_since(self, wall_time: float | None) -> list[dict[str, Any]]:
        if wall_time is None:
            return list(self.points)
        return [p for p in self.points if p["t"] > wall_time]

    def totals(self) -> dict[str, Any]:
        """Cumulative numbers read now (equal to /metrics at this moment, not up to an interval
        old like the series), and the price of a million output tokens over the whole run."""
        latest = take_snapshot(self.source(), self.prefix, self._clock(), self._wall_clock())
        out: dict[str, Any] = {key: latest.value(name) for key, name in TOTALS.items()}
        out["finished_by_reason"] = latest.labeled.get("request_success_total", {})
        out["rejected_by_reason"] = latest.labeled.get("request_rejected_total", {})
        first = self.first
        elapsed = latest.time - first.time if first is not None else 0.0
        if first is not None and elapsed > 0:
            tokens = increase(latest.value("generation_tokens_total"), first.value("generation_tokens_total"))
            out["cost_per_m_output_overall"] = cost_per_million_tokens(self.cost_per_hour, tokens / elapsed)
        out["uptime_s"] = latest.time - self.started
        return out


def point(now: MetricsSnapshot, base: MetricsSnapshot, cost_per_hour: float | None) -> dict[str, Any]:
    """One point of the charts: the window from `base` to `now`."""
    seconds = now.time - base.time
    p: dict[str, Any] = {"t": now.wall_time, "window_s": seconds}
    for key, name in LATENCY_HISTOGRAMS.items():
        histogram = now.histograms.get(name)
        observed = histogram_delta(histogram, base.histograms.get(name)) if histogram is not None else None
        for label, q in QUANTILES.items():
            p[f"{key}_{label}"] = histogram_quantile(q, observed) if observed is not None else None

    def counter_rate(name: str) -> float:
        return rate(now.value(name), base.values.get(name), seconds)

    def counter_increase(name: str) -> float:
        return increase(now.value(name), base.values.get(name))

    p["output_tps"] = counter_rate("generation_tokens_total")
    p["prompt_tps"] = counter_rate("prompt_tokens_total")
    p["requests_ps"] = counter_rate("request_success_total")
    p["running"] = now.value("num_requests_running")
    p["waiting"] = now.value("num_requests_waiting")
    p["kv_usage"] = now.value("kv_cache_usage_perc")
    p["prefix_hit_rate"] = ratio(counter_increase("prefix_cache_hits_total"), counter_increase("prefix_cache_queries_total"))
    p["preemptions"] = counter_increase("num_preemptions_total")
    p["rejections"] = counter_increase("request_rejected_total")
    p["spec_acceptance"] = ratio(
        counter_increase("spec_decode_num_accepted_tokens_total"), counter_increase("spec_decode_num_draft_tokens_total")
    )
    p["lora_in_flight"] = dict(now.labeled.get("lora_requests_in_flight", {}))
    p["cost_per_m_output"] = cost_per_million_tokens(cost_per_hour, p["output_tps"])
    return p
