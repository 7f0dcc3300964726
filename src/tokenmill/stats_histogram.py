"""A cumulative histogram the engine keeps for a duration and reports in its stats dict (plain
floats cross the process boundary): `<name>_sum`, `<name>_count` and one `<name>_bucket_le_<bound>`
per bound. The API server turns those keys back into a Prometheus histogram (metrics.py)."""

from __future__ import annotations

import threading

BUCKET_KEY = "_bucket_le_"


class StatsHistogram:
    def __init__(self, name: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.bounds = tuple(sorted(bounds))
        self.sum = 0.0
        self.count = 0
        self._counts = [0] * len(self.bounds)  # cumulative: values <= each bound
        self._lock = threading.Lock()  # grammar compiles observe from pool threads
        # The keys, formatted once: the engine core sends its stats with every step's outputs.
        self._sum_key = f"{name}_sum"
        self._count_key = f"{name}_count"
        self._bucket_keys = tuple(f"{name}{BUCKET_KEY}{bound!r}" for bound in self.bounds)

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            self.count += 1
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {self._sum_key: self.sum, self._count_key: float(self.count)}
            out.update(zip(self._bucket_keys, map(float, self._counts), strict=True))
        return out


def buckets_from_stats(stats: dict[str, float], name: str) -> tuple[list[tuple[str, float]], float] | None:
    """(Prometheus buckets [(le, cumulative count)...] ending with +Inf, sum) of `name` in `stats`."""
    count = stats.get(f"{name}_count")
    if count is None:
        return None
    prefix = f"{name}{BUCKET_KEY}"
    bounds = sorted((float(key[len(prefix) :]), value) for key, value in stats.items() if key.startswith(prefix))
    buckets = [(repr(bound), value) for bound, value in bounds] + [("+Inf", count)]
    return buckets, stats.get(f"{name}_sum", 0.0)
