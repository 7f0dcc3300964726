"""Metrics read when scraped rather than counted: vLLM's `cache_config_info` (the KV cache's
configuration as labels, value 1) and the LoRA adapters' load — vLLM's `lora_requests_info` (the
adapters with requests in flight as a comma-separated label, the value the scrape's time) and,
ours, `lora_requests_in_flight{lora_name}` (requests in flight per adapter: a number a dashboard
can chart).

With several API server processes (metrics_multiprocess.py) the in-flight counts are per process:
each publishes its own to a summed mmap gauge (ServerMetrics.on_lora_holds_changed), and the
scrape renders both LoRA families from the sums (`families`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LORA_IN_FLIGHT = "lora_requests_in_flight"  # under the metrics prefix
LORA_IN_FLIGHT_DOC = "Requests in flight (waiting or running) per LoRA adapter."


class InfoMetrics(Collector):
    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = prefix
        self._cache_config: dict[str, str] | None = None
        # Requests in flight per served adapter (the API server's LoRA registry), and the engine's
        # --max-loras; None: LoRA off, no series.
        self._lora_load: Callable[[], Mapping[str, int]] | None = None
        self._max_loras = 0

    def set_cache_config(self, **labels: object) -> None:
        self._cache_config = {key: str(value) for key, value in labels.items()}

    def set_lora_load(self, load: Callable[[], Mapping[str, int]], max_loras: int) -> None:
        self._lora_load = load
        self._max_loras = max_loras

    def lora_load(self) -> Mapping[str, int] | None:
        """This process's requests in flight per served adapter; None: LoRA off."""
        return self._lora_load() if self._lora_load is not None else None

    def collect(self) -> Iterator[Metric]:
        return self.families()

    def families(self, summed_in_flight: Mapping[str, float] | None = None) -> Iterator[Metric]:
        """`summed_in_flight`: requests in flight per adapter summed over every API server process
        (multiprocess mode), in place of this process's own counts."""
        if self._cache_config is not None:
            labels = {"model_name": self.model_name, **self._cache_config}
            family = GaugeMetricFamily(
                self.prefix + "cache_config_info", "The KV cache's configuration (value 1).", labels=list(labels)
            )
            family.add_metric(list(labels.values()), 1.0)
            yield family
        if self._lora_load is None:
            return
        load = {name: float(count) for name, count in self._lora_load().items()}
        if summed_in_flight is not None:
            # This process's adapters (0 when idle, as with one process), plus any adapter another
            # process has requests on.
            load = {name: summed_in_flight.get(name, 0.0) for name in load}
            load.update((name, count) for name, count in summed_in_flight.items() if count > 0)
        in_flight = GaugeMetricFamily(
            self.prefix + LORA_IN_FLIGHT, LORA_IN_FLIGHT_DOC, labels=["model_name", "lora_name"]
        )
        for name, count in sorted(load.items()):
            in_flight.add_metric([self.model_name, name], float(count))
        yield in_flight
        info = GaugeMetricFamily(
            self.prefix + "lora_requests_info",
            "vLLM's LoRA info: adapters with requests in flight (running_lora_adapters; this server does "
            "not split running from waiting, so waiting_lora_adapters is empty); the value is the time.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running = ",".join(sorted(name for name, count in load.items() if count > 0))
        info.add_metric([str(self._max_loras), running, ""], time.time())
        yield info
