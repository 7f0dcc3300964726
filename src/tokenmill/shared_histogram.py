"""A Prometheus histogram observed once and exported under several names.

The inter-token-latency histogram is observed for every streamed token and exported twice (vLLM's
current name and its older one). Two prometheus_client Histograms cost two bucket searches and
four locked increments a token; this keeps one set of bucket counts, found by bisection, and a
collector renders it under each name (the same samples a prometheus_client Histogram with those
buckets would export: tests/unit/test_metrics.py). Observed from the API server's event loop.

In multiprocess mode (metrics_multiprocess.py) only prometheus_client's own metrics reach the
shared mmap files, so there the names are plain Histograms, fed in batches (`BufferedHistograms`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BucketCounts:
    """Observations counted per bucket (not cumulative), found by bisection, with their sum: the
    prometheus_client Histogram rule (a value goes to the first bound >= it; the last bound is
    +Inf). What SharedHistogram exports and BufferedHistograms hands on."""

    def __init__(self, buckets: Iterable[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value


class SharedHistogram(BucketCounts, Collector):
    def __init__(
        self, names: Iterable[tuple[str, str]], buckets: Iterable[float], model_name: str
    ) -> None:
        """`names`: (metric name, help text) pairs, each exported with the same samples."""
        super().__init__(buckets)
        self.names = list(names)
        self.model_name = model_name

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        for name, documentation in self.names:
            family = HistogramMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], buckets, self._sum)
            yield family


class BufferedHistograms(BucketCounts):
    """The multiprocess-mode stand-in for SharedHistogram: observations counted here as
    SharedHistogram counts them, added to prometheus_client Histograms (whose values live in the
    shared mmap files) by `flush`, once per engine message rather than per token.

    Observing a multiprocess Histogram per token cost ~36 % of a loaded API server process's CPU
    (py-spy, 128 streams: two mmap increments, each with a pid check and a lock, per histogram and
    token). prometheus_client has no call that adds counts to a bucket, so `flush` increments the
    child's bucket and sum values directly (`_buckets`, `_sum`, `_upper_bounds`: the fields its own
    `observe` uses); tests/unit/test_metrics.py checks the export equals per-token `observe`.
    """

    def __init__(self, histograms: Sequence[Histogram]) -> None:
        """`histograms`: labelled children (`.labels(...)`) with the same buckets."""
        self._histograms = tuple(histograms)
        bounds = [list(h._upper_bounds) for h in self._histograms]
        if any(b != bounds[0] for b in bounds):
            raise ValueError("BufferedHistograms needs histograms with the same buckets")
        super().__init__(bounds[0])

    def flush(self) -> None:
        counts, total = self._counts, self._sum
        if not any(counts):
            return
        self._counts, self._sum = [0] * len(self._bounds), 0.0
        for histogram in self._histograms:
            histogram._sum.inc(total)
            for value, count in zip(histogram._buckets, counts, strict=True):
                if count:
                    value.inc(count)
