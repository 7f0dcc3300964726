"""Prometheus metrics for the server, with vLLM's names under the `tokenmill:` prefix.

Each server owns a `ServerMetrics` with its own `CollectorRegistry` (never the process-global
one), so several servers or tests in one process do not collide. Request-level observations come
from the API server as tokens stream out; engine-level numbers arrive as absolute totals in engine
stats and are turned into counter increments here.

Several API server processes (`--api-server-count`) share prometheus_client's multiprocess mode
(metrics_multiprocess.py): each process's metrics live in mmap files and a scrape of any process
merges them. Every process receives the same engine stats, so only the one built with
`engine_stats_owner=True` feeds the engine's totals and gauges into those files (the sum would count
them N times); histograms the engine itself keeps are identical everywhere and rendered locally.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from tokenmill.metrics_info import LORA_IN_FLIGHT, LORA_IN_FLIGHT_DOC, InfoMetrics
from tokenmill.metrics_multiprocess import MergedMetrics, check_enabled, multiprocess_metrics_dir
from tokenmill.shared_histogram import BufferedHistograms, SharedHistogram
from tokenmill.slo_metrics import SloMetrics
from tokenmill.stats_histogram import buckets_from_stats

PREFIX = "tokenmill:"
# --metrics-prefix: `vllm` gives vLLM's exact names (`vllm:time_to_first_token_seconds`...), so
# dashboards and alerts written for vLLM work unchanged.
METRICS_PREFIXES = {"tokenmill": "tokenmill:", "vllm": "vllm:"}
# Histograms kept in the engine process and reported in its stats (core/stats_histogram.py).
ENGINE_HISTOGRAMS = {
    "structured_output_compile_seconds": "Time compiling a structured-output grammar (cache misses).",
    "structured_output_mask_seconds": "Host time filling the grammar bitmask of one step with constrained requests.",
    "iteration_tokens_total": "Tokens computed per engine step (prompt and output tokens together).",
}
# Speculative decoding totals in engine stats (vLLM's counter names): drafts (request-steps that
# verified any), draft tokens, accepted tokens, and accepted tokens per draft position, whose stats
# keys carry the 0-based position after a dot ("spec_decode_num_accepted_tokens_per_pos.0").
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Request-steps that verified draft tokens.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the target model.",
}
SPEC_DECODE_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
# Host-memory KV tier (--kv-offload-gb) totals and gauges in engine stats; like speculative
# decoding's, a series appears only once the engine reports its key (a server without the tier
# exports none).
KV_OFFLOAD_COUNTERS = {
    "kv_offload_hits": "Prompt tokens whose KV was loaded from the host-memory tier instead of computed.",
    "kv_offload_blocks_stored": "KV blocks copied to the host-memory tier when the device prefix cache evicted them.",
    "kv_offload_blocks_loaded": "KV blocks copied back from the host-memory tier on a prefix hit.",
    "kv_offload_saves_dropped": "Evicted KV blocks not stored because every host slot was in use by the step.",
    # Disaggregated prefill / decode (--kv-role): a producer reports what it sent, a consumer the rest.
    "kv_transfer_blocks_sent": "Prompt KV blocks a producer sent to its consumer.",
    "kv_transfer_hits": "Prompt tokens a consumer loaded from received blocks instead of computing them.",
    "kv_transfer_blocks_received": "KV blocks a consumer received.",
    "kv_transfer_blocks_claimed": "Received KV blocks a request started from.",
    "kv_transfer_blocks_expired": "Received KV blocks dropped unclaimed (claim timeout or buffer bound).",
    "kv_transfer_messages_refused": "KV transfers refused (undecodable, corrupt, or another KV layout).",
    "kv_transfer_wait_timeouts": "Consumer requests whose named transfer did not arrive within --kv-transfer-wait.",
}
KV_OFFLOAD_GAUGES = {
    "kv_offload_bytes": "Bytes of KV blocks held in the host-memory tier.",
    "kv_offload_capacity_bytes": "Bytes the host-memory tier can hold.",
}
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error", "shed")  # shed: the slo policy gave up on it
# Why a request was refused before it reached the engine (the `reason` of request_rejected_total):
# invalid 400 / 405, unauthorized 401, not_found 404 (unknown model or route), timeout 408 (body
# too slow), too_large 413 / 431, queue_full 429 (admission), unavailable 503 (starting, draining,
# engine dead).
REJECTION_REASONS = (
    "invalid",
    "unauthorized",
    "not_found",
    "timeout",
    "too_large",
    "queue_full",
    "unavailable",
)

# Buckets span a fast GPU (milliseconds) and a laptop CPU running a long prompt (minutes).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Token counts and request parameters: 1, 2, 5, 10, 20, 50, ... (vLLM's 1-2-5 series).
TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
# Gauges' multiprocess_mode (ignored with one process). The engine's gauges are set by the engine
# stats owner alone and stay 0 elsewhere, and kv_transfer_info is 1 in every process: the largest
# value of the live processes is right for both. Requests in flight per LoRA adapter add up.
ENGINE_GAUGE_MODE = "livemax"
LORA_IN_FLIGHT_MODE = "livesum"


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix: str = PREFIX,
        *,
        multiprocess_dir: str | None = None,
        engine_stats_owner: bool = True,
    ) -> None:
        """`multiprocess_dir`: one of several API server processes; the directory must be the one
        `enable_multiprocess_metrics` switched this process to. `engine_stats_owner`: this process
        feeds the engine's totals and gauges (exactly one process of a server)."""
        # The `_created` timestamp series only add noise (vLLM turns them off too); the switch
        # is process-wide in prometheus_client.
        disable_created_metrics()
        if multiprocess_dir is not None:
            multiprocess_dir = check_enabled(multiprocess_dir)
        elif multiprocess_metrics_dir() is not None:
            # Its values would go to the shared files all the same, and be summed into another server's.
            raise RuntimeError(
                f"multiprocess metrics are enabled in this process ({multiprocess_metrics_dir()}): pass it as "
                "multiprocess_dir"
            )
        elif not engine_stats_owner:
            raise ValueError("engine_stats_owner=False needs multiprocess_dir: a lone process owns the engine stats")
        self.model_name = model_name
        self.prefix = prefix
        self.multiprocess_dir = multiprocess_dir
        self.engine_stats_owner = engine_stats_owner
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Every prometheus_client metric made here: multiprocess mode exports the families that have
        # no series yet from this list (metrics_multiprocess.MergedMetrics).
        self._declared: list[MetricWrapperBase] = []
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            # prometheus_client appends `_total` to counter names on export.
            metric = Counter(prefix + name, doc, labels + list(extra), registry=self.registry)
            self._declared.append(metric)
            return metric

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(prefix + name, doc, labels, registry=self.registry, multiprocess_mode=ENGINE_GAUGE_MODE)
            self._declared.append(metric)
            return metric

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(prefix + name, doc, labels, buckets=buckets, registry=self.registry)
            self._declared.append(metric)
            return metric

        self._request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        for reason in FINISH_REASONS:  # export zeros so dashboards and tests see every series
            self._request_success.labels(model_name, reason)
        self._request_rejected = counter(
            "request_rejected", "Requests refused before reaching the engine, by reason.", ("reason",)
        )
        for reason in REJECTION_REASONS:
            self._request_rejected.labels(model_name, reason)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(
            model_name
        )
        self._generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self._prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self._prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(model_name)
        self._num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.").labels(
            model_name
        )
        self._ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        ).labels(model_name)
        # Observed for every streamed token: one set of buckets under vLLM's name and under its older
        # one, still queried by dashboards written for it (shared_histogram.py).
        itl_names = [
            ("inter_token_latency_seconds", "Time between consecutive output tokens."),
            ("time_per_output_token_seconds", "Time between consecutive output tokens (vLLM's older name)."),
        ]
        self._itl: SharedHistogram | BufferedHistograms
        if multiprocess_dir is None:
            self._itl = SharedHistogram([(prefix + n, doc) for n, doc in itl_names], ITL_BUCKETS, model_name)
            self.registry.register(self._itl)
        else:  # mmap files hold only prometheus_client's metrics
            self._itl = BufferedHistograms([histogram(n, doc, ITL_BUCKETS).labels(model_name) for n, doc in itl_names])
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_LATENCY_BUCKETS
        ).labels(model_name)
        self._queue_time = histogram(
            "request_queue_time_seconds",
            "Time spent waiting before first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        # vLLM's per-request phases: prefill = first scheduled to first token, decode = first to last
        # token, inference = both (all from the API server's clock, with the engine's queue time).
        self._tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            ITL_BUCKETS,
        ).labels(model_name)
        self._prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first scheduled to the first token.", REQUEST_LATENCY_BUCKETS
        ).labels(model_name)
        self._decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS
        ).labels(model_name)
        self._inference_time = histogram(
            "request_inference_time_seconds", "Time from first scheduled to the last token.", REQUEST_LATENCY_BUCKETS
        ).labels(model_name)
        self._request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        ).labels(model_name)
        self._request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per sequence.", TOKEN_COUNT_BUCKETS
        ).labels(model_name)
        self._max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The most tokens any of a request's n sequences generated.",
            TOKEN_COUNT_BUCKETS,
        ).labels(model_name)
        self._params_n = histogram("request_params_n", "The n of each request.", N_BUCKETS).labels(model_name)
        self._params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens of each request (max_model_len - prompt when unset).",
            TOKEN_COUNT_BUCKETS,
        ).labels(model_name)
        self._num_running = gauge("num_requests_running", "Requests in the running batch.").labels(model_name)
        self._num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(
            model_name
        )
        self._kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."
        ).labels(model_name)
        # Engine stats keys holding absolute totals, and the counter each one feeds.
        self._engine_counters = {
            "prefix_cache_queries": self._prefix_cache_queries,
            "prefix_cache_hits": self._prefix_cache_hits,
            "num_preemptions_total": self._num_preemptions,
        }
        self._last_totals: dict[str, float] = {}
        # Speculative decoding: the counters are declared up front, but a series (a labelled
        # child) appears only once the engine reports its key, so a server without speculation
        # exports none rather than zeros that would read as "nothing accepted".
        self._spec_decode = {
            key: counter(key, doc) for key, doc in SPEC_DECODE_COUNTERS.items()
        }
        self._spec_decode_per_position = counter(
            SPEC_DECODE_PER_POSITION,
            "Draft tokens accepted at each draft position (0-based): the request-steps whose "
            "first position + 1 drafts were all accepted.",
            ("position",),
        )
        self._kv_offload_counters = {key: counter(key, doc) for key, doc in KV_OFFLOAD_COUNTERS.items()}
        self._kv_offload_gauges = {key: gauge(key, doc) for key, doc in KV_OFFLOAD_GAUGES.items()}
        # Histograms the engine keeps itself (grammar compiles, per-step bitmask fills): their
        # latest buckets, exported as they are.
        self._engine_histograms = EngineHistograms(model_name, ENGINE_HISTOGRAMS, prefix)
        self.registry.register(self._engine_histograms)
        # cache_config_info (once the engine is up) and the LoRA adapters' load (metrics_info.py).
        self.info = InfoMetrics(model_name, prefix)
        self.registry.register(self.info)
        self._slo = SloMetrics(prefix, model_name, self.registry)  # goodput, SLO attainment
        self._declared.extend(self._slo.counters)
        # Multiprocess mode: this process's requests in flight per LoRA adapter, summed over the
        # processes in the files and rendered by `info` (not in `registry`: `info` renders it there).
        self._lora_in_flight: Gauge | None = None
        self._lora_published: dict[str, int] = {}
        # What GET /metrics renders: `registry` itself with one process; with several, the merged
        # files and the collectors that are the same in every process, never `registry`'s own
        # prometheus_client metrics (the files hold them already).
        self.scrape_registry = self.registry
        if multiprocess_dir is not None:
            self._lora_in_flight = Gauge(
                prefix + LORA_IN_FLIGHT, LORA_IN_FLIGHT_DOC, ["model_name", "lora_name"], registry=None,
                multiprocess_mode=LORA_IN_FLIGHT_MODE,
            )  # fmt: skip
            self.scrape_registry = CollectorRegistry(auto_describe=False)
            merged = MergedMetrics(
                multiprocess_dir, self._declared, prefix + LORA_IN_FLIGHT, "lora_name", self.info.families
            )
            self.scrape_registry.register(merged)
            self.scrape_registry.register(self._engine_histograms)

    # ------------------------------------------------------------------ request-level observations

    def set_kv_transfer(self, role: str, address: str) -> None:
        """--kv-role: exported so that a router in disaggregated mode sends each request's decode to
        a consumer its producer feeds (the same --kv-transfer-address)."""
        info = Gauge(
            self.prefix + "kv_transfer_info", "1, labelled with this server's --kv-role and --kv-transfer-address.",
            ["model_name", "kv_role", "kv_transfer_address"], registry=self.registry,
            multiprocess_mode=ENGINE_GAUGE_MODE,
        )  # fmt: skip
        self._declared.append(info)
        info.labels(self.model_name, role, address).set(1)

    def on_lora_holds_changed(self) -> None:
        """LoRARegistry.on_holds_changed: a request took or gave back an adapter. In multiprocess
        mode this process's counts go to the shared files (only the ones that changed); with one
        process a no-op, the scrape reads the counts itself."""
        gauge = self._lora_in_flight
        if gauge is None:  # one process: nothing to publish (and no per-request dict to build)
            return
        load = self.info.lora_load()
        if load is None:
            return
        for name, count in load.items():
            if self._lora_published.get(name) != count:
                gauge.labels(self.model_name, name).set(count)
                self._lora_published[name] = count
        for name in [n for n in self._lora_published if n not in load]:  # unloaded
            gauge.labels(self.model_name, name).set(0)
            del self._lora_published[name]

    def on_first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def on_token_gap(self, itl: float) -> None:
        self._itl.observe(itl)

    def on_request_params(self, n: int, max_tokens: int) -> None:
        """One admitted request's n and (effective) max_tokens."""
        self._params_n.observe(n)
        self._params_max_tokens.observe(max_tokens)

    def on_request_max_generation_tokens(self, tokens: int) -> None:
        """A prompt's n sequences all finished: the longest one's output tokens."""
        self._max_generation_tokens.observe(tokens)

    def on_request_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e: float,
        queue_time: float | None = None,
        ttft: float | None = None,
    ) -> None:
        """One finished engine sequence; `prompt_tokens` is 0 for the 2nd..nth of a request's n
        (its prompt counts once). `ttft` None: it produced no token."""
        self._request_success.labels(self.model_name, finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        if prompt_tokens:
            self._request_prompt_tokens.observe(prompt_tokens)
        self._request_generation_tokens.observe(generation_tokens)
        self._e2e.observe(e2e)
        if queue_time is not None:
            self._queue_time.observe(queue_time)
            self._inference_time.observe(max(0.0, e2e - queue_time))
        if ttft is not None:
            self._decode_time.observe(max(0.0, e2e - ttft))
            if queue_time is not None:
                self._prefill_time.observe(max(0.0, ttft - queue_time))
            if generation_tokens > 1:
                self._tpot.observe((e2e - ttft) / (generation_tokens - 1))

    def on_request_rejected(self, reason: str) -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {REJECTION_REASONS}")
        self._request_rejected.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ engine-level stats

    def update_engine_stats(self, stats: Mapping[str, float]) -> None:
        """Take the engine's absolute numbers; missing keys are left as they were.

        Counters grow by the difference from the previous totals. A total smaller than the one
        before means the engine restarted from zero, so the whole new total is counted. Only the
        engine stats owner feeds counters and gauges; every process keeps the engine's histograms
        (rendered by the process scraped).
        """
        self.flush()
        if self.engine_stats_owner:
            self._update_engine_series(stats)
        self._engine_histograms.update(stats)

    def _update_engine_series(self, stats: Mapping[str, float]) -> None:
        if "num_running" in stats:
            self._num_running.set(stats["num_running"])
        if "num_waiting" in stats:
            self._num_waiting.set(stats["num_waiting"])
        if "kv_cache_usage" in stats:
            self._kv_cache_usage.set(stats["kv_cache_usage"])
        for key, counter in self._engine_counters.items():
            if key in stats:
                self._count_total(key, float(stats[key]), counter)
        for key, family in self._spec_decode.items():
            if key in stats:
                self._count_total(key, float(stats[key]), family.labels(self.model_name))
        for key, family in self._kv_offload_counters.items():
            if key in stats:
                self._count_total(key, float(stats[key]), family.labels(self.model_name))
        for key, gauge_family in self._kv_offload_gauges.items():
            if key in stats:
                gauge_family.labels(self.model_name).set(float(stats[key]))
        per_position_prefix = SPEC_DECODE_PER_POSITION + "."
        for key, total in stats.items():
            if key.startswith(per_position_prefix):
                position = key[len(per_position_prefix) :]
                child = self._spec_decode_per_position.labels(self.model_name, position)
                self._count_total(key, float(total), child)
        self._slo.update(stats, self._count_total)

    def _count_total(self, key: str, total: float, counter: Counter) -> None:
        """Grow `counter` by what the engine total `key` gained since its last report."""
        last = self._last_totals.get(key, 0.0)
        delta = total - last if total >= last else total
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def flush(self) -> None:
        """Multiprocess mode: this process's buffered inter-token latencies into the shared files
        (done with every engine message and before a scrape; a no-op with one process)."""
        if isinstance(self._itl, BufferedHistograms):
            self._itl.flush()

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector, for GET /metrics (in multiprocess
        mode, the whole server's: every API server process's metrics merged)."""
        self.flush()
        return generate_latest(self.scrape_registry)


class EngineHistograms(Collector):
    """Prometheus histograms whose buckets the engine counts (only plain numbers cross the process
    boundary); each scrape reports the latest ones."""

    def __init__(self, model_name: str, histograms: Mapping[str, str], prefix: str = PREFIX) -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.histograms = dict(histograms)
        self._latest: dict[str, tuple[list[tuple[str, float]], float]] = {}

    def update(self, stats: Mapping[str, float]) -> None:
        for name in self.histograms:
            found = buckets_from_stats(dict(stats), name)
            if found is not None:
                self._latest[name] = found

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for name, documentation in self.histograms.items():
            family = HistogramMetricFamily(self.prefix + name, documentation, labels=["model_name"])
            if name in self._latest:
                buckets, total = self._latest[name]
                family.add_metric([self.model_name], buckets, total)
            yield family
