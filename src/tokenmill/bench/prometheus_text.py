"""Read a server's /metrics (Prometheus text format) and summarize what a histogram gained in between.

Used by the structured-output workload to report the engine's grammar compile and mask times:
scrape before a phase, scrape after, and take quantiles of the difference of the bucket counts
(as Prometheus' histogram_quantile does). Torch-free and parser-light: only the sample lines
matter here, comments and types are skipped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import aiohttp

# name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_samples(text: str) -> Samples:
    """Sample name -> [(labels, value)], for every sample line of an exposition."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, _, labels_text, value = match.group(1), match.group(2), match.group(3), match.group(4)
        labels = dict(_LABEL.findall(labels_text or ""))
        try:
            samples.setdefault(name, []).append((labels, float(value)))
        except ValueError:
            continue  # not a number: not ours to judge
    return samples


async def scrape(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> Samples | None:
    """The server's /metrics, parsed; None when it has none (a missing metric is reported, not fatal)."""
    try:
        async with session.get(base_url + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            return parse_samples(await resp.text())
    except aiohttp.ClientError:
        return None


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    count: float
    total: float  # seconds (the _sum series)
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), sorted; empty: no buckets

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank q * count, as histogram_quantile does."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):  # in the +Inf bucket: the best answer is the largest finite bound
                    return lower_bound
                width = cumulative - lower_count
                fraction = (rank - lower_count) / width if width > 0 else 1.0
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    def summary(self) -> dict[str, float | None]:
        return {
            "count": self.count,
            "mean_s": self.total / self.count if self.count > 0 else None,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
        }


def _summed(samples: Samples, name: str, drop: str | None = None) -> dict[str, float]:
    """Values of one sample name summed over every label set, keyed by the label `drop` kept apart."""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        key = labels.get(drop, "") if drop else ""
        out[key] = out.get(key, 0.0) + value
    return out


def histogram_delta(before: Samples | None, after: Samples, name: str) -> HistogramDelta | None:
    """What histogram (or summary) `name` gained between two scrapes, summed over its labels; None if absent.

    Without a `before` scrape the whole `after` counts. A summary (only _sum and _count) gives a
    delta without buckets: its mean is known, its quantiles are not.
    """
    if f"{name}_count" not in after:
        return None
    before = before or {}

    def delta(suffix: str, drop: str | None = None) -> dict[str, float]:
        now, then = _summed(after, name + suffix, drop), _summed(before, name + suffix, drop)
        return {k: v - then.get(k, 0.0) for k, v in now.items()}

    count = delta("_count").get("", 0.0)
    total = delta("_sum").get("", 0.0)
    buckets = sorted((float(le), c) for le, c in delta("_bucket", "le").items() if le)
    return HistogramDelta(count, total, tuple(buckets))
