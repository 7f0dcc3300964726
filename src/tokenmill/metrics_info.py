"""Metrics read when scraped rather than counted: vLLM's `cache_config_info` (the KV cache's
configuration as labels, value 1) and the LoRA adapters' load — vLLM's `lora_requests_info` (the
adapters with requests in flight as a comma-separated label, the value the scrape's time) and,
ours, `lora_requests_in_flight{lora_name}` (requests in flight per adapter: a number a dashboard
can chart)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


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

    def collect(self) -> Iterator[Metric]:
        if self._cache_config is not None:
            labels = {"model_name": self.model_name, **self._cache_config}
            family = GaugeMetricFamily(
                self.prefix + "cache_config_info", "The KV cache's configuration (value 1).", labels=list(labels)
            )
            family.add_metric(list(labels.values()), 1.0)
            yield family
        if self._lora_load is None:
            return
        load = dict(self._lora_load())
        in_flight = GaugeMetricFamily(
            self.prefix + "lora_requests_in_flight",
            "Requests in flight (waiting or running) per LoRA adapter.",
            labels=["model_name", "lora_name"],
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
