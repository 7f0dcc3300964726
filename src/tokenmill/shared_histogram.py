"""A Prometheus histogram observed once and exported under several names.

The inter-token-latency histogram is observed for every streamed token and exported twice (vLLM's
current name and its older one). Two prometheus_client Histograms cost two bucket searches and
four locked increments a token; this keeps one set of bucket counts, found by bisection, and a
collector renders it under each name (the same samples a prometheus_client Histogram with those
buckets would export: tests/unit/test_metrics.py). Observed from the API server's event loop.

In multiprocess mode (metrics_multiprocess.py) only prometheus_client's own metrics reach the
shared mmap files, so there the names are plain Histograms, each observed (`HistogramFanout`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class SharedHistogram(Collector):
    def __init__(
        self, names: Iterable[tuple[str, str]], buckets: Iterable[float], model_name: str
    ) -> None:
        """`names`: (metric name, help text) pairs, each exported with the same samples."""
        self.names = list(names)
        self.model_name = model_name
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        for name, documentation in self.names:
            family = HistogramMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], buckets, self._sum)
            yield family


class HistogramFanout:
    """The multiprocess-mode stand-in for SharedHistogram: one observation, every histogram."""

    __slots__ = ("_histograms",)

    def __init__(self, histograms: Sequence[Histogram]) -> None:
        """`histograms`: labelled children (`.labels(...)`), ready to observe."""
        self._histograms = tuple(histograms)

    def observe(self, value: float) -> None:
        for histogram in self._histograms:
            histogram.observe(value)
