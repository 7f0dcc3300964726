"""One reading of every metric under a prefix: plain sums, per-label values and histogram buckets.

A metrics source is any callable returning Prometheus metric families: the API server passes its
registry's `collect` (`registry_source`); a process that only sees /metrics text (a router in
front of several servers) passes `text_source`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

MetricsSource = Callable[[], Iterable[Metric]]
# Labels that never split a series in a snapshot: every series of a server has the same model_name.
_IGNORED_LABELS = frozenset({"model_name", "le"})


def registry_source(registry: CollectorRegistry) -> MetricsSource:
    return registry.collect


def text_source(fetch_text: Callable[[], str]) -> MetricsSource:
    """A source over Prometheus text (e.g. what a backend's /metrics answered)."""
    return lambda: text_string_to_metric_families(fetch_text())


@dataclass(slots=True)
class HistogramCounts:
    bounds: list[float]  # upper bounds, ascending, +Inf last
    counts: list[float]  # cumulative counts, one per bound
    sum: float = 0.0

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0


@dataclass(slots=True)
class MetricsSnapshot:
    time: float  # the clock of the history that took it (monotonic seconds)
    wall_time: float  # Unix seconds, for the page's time axis
    values: dict[str, float] = field(default_factory=dict)  # sample name (no prefix) -> sum over series
    # sample name -> the other labels' values joined with "," -> value (e.g. finished_reason "stop").
    labeled: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, HistogramCounts] = field(default_factory=dict)

    def value(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)


def take_snapshot(families: Iterable[Metric], prefix: str, now: float, wall_time: float) -> MetricsSnapshot:
    snapshot = MetricsSnapshot(now, wall_time)
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for family in families:
        if not family.name.startswith(prefix):
            continue
        is_histogram = family.type == "histogram"
        base = family.name[len(prefix) :]
        for sample in family.samples:
            name = sample.name[len(prefix) :]
            if is_histogram:
                if name == base + "_bucket":
                    le = float(sample.labels["le"])  # "+Inf" parses to inf
                    per_bound = buckets.setdefault(base, {})
                    per_bound[le] = per_bound.get(le, 0.0) + sample.value
                elif name == base + "_sum":
                    sums[base] = sums.get(base, 0.0) + sample.value
                continue
            snapshot.values[name] = snapshot.values.get(name, 0.0) + sample.value
            key = ",".join(v for k, v in sorted(sample.labels.items()) if k not in _IGNORED_LABELS)
            if key:
                per_label = snapshot.labeled.setdefault(name, {})
                per_label[key] = per_label.get(key, 0.0) + sample.value
    for base, per_bound in buckets.items():
        bounds = sorted(per_bound)
        if not bounds or not math.isinf(bounds[-1]):
            continue  # a histogram without its +Inf bucket is malformed: left out
        snapshot.histograms[base] = HistogramCounts(bounds, [per_bound[b] for b in bounds], sums.get(base, 0.0))
    return snapshot
