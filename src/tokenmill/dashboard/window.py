"""The arithmetic of a time window between two snapshots: what a histogram observed in it, its
quantiles (as Prometheus' histogram_quantile computes them), counter increases and rates, and the
price of a million output tokens."""

from __future__ import annotations

import math

from tokenmill.dashboard.snapshot import HistogramCounts


def histogram_delta(new: HistogramCounts, old: HistogramCounts | None) -> HistogramCounts:
    """What `new` observed since `old` (bucket by bucket). A count that went down means the
    source restarted: then everything in `new` is new."""
    if old is None or old.bounds != new.bounds or any(n < o for n, o in zip(new.counts, old.counts, strict=True)):
        return new
    return HistogramCounts(
        new.bounds, [n - o for n, o in zip(new.counts, old.counts, strict=True)], new.sum - old.sum
    )


def histogram_quantile(q: float, histogram: HistogramCounts) -> float | None:
    """The q-quantile (0..1) by linear interpolation inside the bucket holding it; None with no
    observations. Values in the +Inf bucket report the largest finite bound (as Prometheus does);
    the first bucket's lower edge is 0 (durations and counts are never negative)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is between 0 and 1, got {q}")
    total = histogram.count
    if total <= 0:
        return None
    rank = q * total
    bounds, counts = histogram.bounds, histogram.counts
    for i, cumulative in enumerate(counts):
        if cumulative >= rank and cumulative > 0:
            upper = bounds[i]
            if math.isinf(upper):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            lower = bounds[i - 1] if i > 0 else 0.0
            below = counts[i - 1] if i > 0 else 0.0
            in_bucket = cumulative - below
            if in_bucket <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / in_bucket
    return None


def increase(new: float, old: float | None) -> float:
    """A counter's increase; a decrease means the counter restarted from zero."""
    if old is None:
        return new
    return new - old if new >= old else new


def rate(new: float, old: float | None, seconds: float) -> float:
    return increase(new, old) / seconds if seconds > 0 else 0.0


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def cost_per_million_tokens(cost_per_hour: float | None, tokens_per_second: float) -> float | None:
    """Dollars per million tokens at `tokens_per_second` on hardware costing `cost_per_hour`;
    None without a price or without tokens."""
    if cost_per_hour is None or tokens_per_second <= 0:
        return None
    return cost_per_hour / (tokens_per_second * 3600.0) * 1e6
