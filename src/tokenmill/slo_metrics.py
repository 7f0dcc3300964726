"""Prometheus counters of the `slo` scheduling policy: goodput, and SLO attainment by class.

The engine's slo queue (core/slo_queue.py) counts, as absolute totals in its stats, the requests
that completed within their latency targets (goodput), missed them, or were shed before they
started; per SLO class (the priority that picked a `--slo-class`, or "default"). Here they become
counters:

- `tokenmill:goodput_requests_total`: requests that completed within every target they had;
- `tokenmill:slo_attained_requests_total{slo_class}`, `..._missed_...` (shed ones included),
  `tokenmill:slo_shed_requests_total{slo_class}`.

A server under another policy reports none of these keys and exports no series. The counts are the
engine's: with several API server processes only the engine stats owner feeds them (metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter

# Engine stats keys (core/slo_queue.py); the per-class ones carry ".<class>".
GOODPUT_KEY = "slo_goodput_requests"
PER_CLASS_KEYS = {
    "slo_attained_requests": "Requests that completed within their SLO targets, by SLO class.",
    "slo_missed_requests": "Requests that missed an SLO target or were shed, by SLO class.",
    "slo_shed_requests": "Requests the slo scheduler shed (429) before they started, by SLO class.",
}

# (stats key, its total, the counter child it feeds): ServerMetrics._count_total.
CountTotal = Callable[[str, float, Counter], None]


class SloMetrics:
    def __init__(self, prefix: str, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self._goodput = Counter(
            prefix + "goodput_requests",
            "Requests that completed within every SLO target they had (the slo scheduling policy).",
            ["model_name"],
            registry=registry,
        )
        self._per_class = {
            key: Counter(prefix + key, doc, ["model_name", "slo_class"], registry=registry)
            for key, doc in PER_CLASS_KEYS.items()
        }
        # Every family, declared even before the engine reports a key (ServerMetrics exports them
        # all in multiprocess mode too).
        self.counters: list[Counter] = [self._goodput, *self._per_class.values()]

    def update(self, stats: Mapping[str, float], count_total: CountTotal) -> None:
        if GOODPUT_KEY in stats:
            count_total(GOODPUT_KEY, float(stats[GOODPUT_KEY]), self._goodput.labels(self.model_name))
        for key, total in stats.items():
            name, dot, slo_class = key.partition(".")
            if dot and name in self._per_class:
                count_total(key, float(total), self._per_class[name].labels(self.model_name, slo_class))
