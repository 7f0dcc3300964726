"""Prometheus multiprocess mode for several API server processes in front of one engine.

With `--api-server-count N` a scrape of /metrics reaches any one of the N processes, so each must
export the whole server's numbers. prometheus_client's multiprocess mode keeps every metric value
in per-process mmap files in one shared directory, and a MultiProcessCollector merges the files at
scrape time (counters and histograms summed, gauges by their `multiprocess_mode`).

prometheus_client picks its value class once, when it is first imported, from the
PROMETHEUS_MULTIPROC_DIR environment variable; but the CLI parser imports it before we know how many
API servers there will be. So the switch is made at runtime, in each API server process and before
any metric is created: `enable_multiprocess_metrics` sets the variable (read by the collector and
inherited by processes started later) and replaces `prometheus_client.values.ValueClass`, which
every metric reads when it is created. Metrics created before the switch stay process-local.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"

_enabled_dir: str | None = None


def enable_multiprocess_metrics(path: str) -> None:
    """Switch this process's prometheus_client to mmap values in the existing directory `path`.

    Idempotent for the same directory. RuntimeError if another directory is already in use in this
    process, or if `path` is not an existing directory."""
    global _enabled_dir
    directory = os.path.realpath(path)
    if _enabled_dir is not None:
        if _enabled_dir != directory:
            raise RuntimeError(
                f"multiprocess metrics are already enabled in this process with {_enabled_dir}; "
                f"cannot switch to {directory}"
            )
        return
    if not os.path.isdir(directory):
        raise RuntimeError(
            f"the multiprocess metrics directory {path!r} does not exist (or is not a directory)"
        )
    if getattr(values.ValueClass, "_multiprocess", False):
        # prometheus_client was imported with the variable already set (inherited from a parent):
        # its mmap value class is in use. A second one would open the same per-process files
        # twice and the two would overwrite each other's entries, so it is kept if it is ours.
        inherited = os.environ.get(ENV_VAR)
        if inherited is None or os.path.realpath(inherited) != directory:
            raise RuntimeError(
                f"prometheus_client already runs in multiprocess mode with {ENV_VAR}={inherited}; "
                f"cannot switch to {directory}"
            )
    else:
        values.ValueClass = values.MultiProcessValue()
    os.environ[ENV_VAR] = directory
    _enabled_dir = directory


def multiprocess_metrics_dir() -> str | None:
    """The directory `enable_multiprocess_metrics` switched to; None in the default (one-process) mode."""
    return _enabled_dir


def check_enabled(path: str) -> str:
    """`path` normalized, if it is the enabled directory; RuntimeError otherwise (a ServerMetrics
    built for multiprocess mode whose values would not reach the files it scrapes)."""
    directory = os.path.realpath(path)
    if _enabled_dir != directory:
        enabled = "not enabled" if _enabled_dir is None else f"enabled with {_enabled_dir}"
        raise RuntimeError(
            f"metrics for the multiprocess directory {directory}, but multiprocess metrics are {enabled} in "
            f"this process: call enable_multiprocess_metrics({path!r}) before creating any metric"
        )
    return directory


class MergedMetrics(Collector):
    """Every API server process's prometheus_client metrics, merged from the mmap files.

    Two additions make the export match a one-process server's:
    - `declared`: metrics created here whose families have no series yet (e.g. speculative decoding's
      before the engine reports them) are absent from the files; they are exported empty, as a
      one-process registry exports them.
    - the family named `intercepted` (a summed mmap gauge) is not exported as it is; its values by
      `intercept_label` go to `render_intercepted`, which yields the families built from them (the
      LoRA adapters' load: metrics_info.py).
    """

    def __init__(
        self,
        path: str,
        declared: Sequence[MetricWrapperBase],
        intercepted: str,
        intercept_label: str,
        render_intercepted: Callable[[Mapping[str, float]], Iterator[Metric]],
    ) -> None:
        self._files = MultiProcessCollector(None, path=path)  # not registered: collected from here
        self._declared = declared  # a live list: metrics created later (kv_transfer_info) count
        self._intercepted = intercepted
        self._intercept_label = intercept_label
        self._render_intercepted = render_intercepted

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        intercepted: dict[str, float] = {}
        for family in self._files.collect():
            if family.name == self._intercepted:
                for sample in family.samples:
                    key = sample.labels[self._intercept_label]
                    intercepted[key] = intercepted.get(key, 0.0) + sample.value
                continue
            seen.add(family.name)
            yield family
        for metric in self._declared:
            for family in metric.describe():
                if family.name not in seen:
                    yield family
        yield from self._render_intercepted(intercepted)
