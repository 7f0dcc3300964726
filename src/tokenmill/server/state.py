"""What every route handler shares: the engine, the model's names, limits, metrics, life-cycle flags."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.dashboard import MetricsHistory, RecentRequests, registry_source
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.otel_spans import TRACE_HEADERS, TraceContext
from tokenmill.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError, TokenmillError
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics import ServerMetrics
from tokenmill.outputs import RequestOutput
from tokenmill.server.admission import AdmissionControl
from tokenmill.server.lora_registry import LoRARegistry
from tokenmill.server.operator_options import CorsOptions


class ServiceUnavailableError(TokenmillError):
    status_code = 503
    error_type = "service_unavailable"


@dataclass
class ServerState:
    engine: AsyncEngine
    model_names: list[str]  # the first is the canonical id; all are accepted in requests
    model_root: str
    metrics: ServerMetrics
    api_key: str | None = None  # one key; `api_keys` holds every accepted key (this one too)
    api_keys: tuple[str, ...] = ()
    cors: CorsOptions | None = None  # --allowed-origins and friends; None: no CORS headers
    root_path: str = ""  # --root-path: the prefix a proxy serves the API under
    max_n: int = 16
    max_body_bytes: int = 8 * 2**20
    request_timeout: float | None = None
    # Seconds a request may wait for its first token before it is aborted (--max-queue-time).
    max_queue_time: float | None = None
    # Seconds a client may take to send a request's body (--client-read-timeout); then 408.
    client_read_timeout: float | None = 30.0
    # Seconds one write of a stream may wait on a client that stopped reading
    # (--stream-write-timeout); then the stream and its request end. None: no limit.
    stream_write_timeout: float | None = 120.0
    # Bound on a request's target plus headers (--max-header-bytes); beyond it 431 (or 400 from h11).
    max_header_bytes: int = 64 * 2**10
    enable_debug_endpoints: bool = False  # GET /debug/invariants (--enable-debug-endpoints)
    # The model's sampling defaults for fields a request leaves unset (--generation-config).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    scheduling_policy: str = "fcfs"  # priority is honoured only under "priority"
    kv_role: str | None = None  # --kv-role: kv_transfer_params is honoured only with one
    # Tool calling and reasoning (--enable-auto-tool-choice, --tool-call-parser, --reasoning-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False  # a request may bring its own chat_template
    admission: AdmissionControl = field(default_factory=AdmissionControl)
    lora: LoRARegistry | None = None  # the served LoRA adapters; None: LoRA off (--enable-lora)
    cost_per_hour: float | None = None  # --cost-per-hour: the dashboard's $ per million output tokens
    # The dashboard's time series (sampled from `metrics`) and recent requests' timelines; built
    # from `metrics` and `cost_per_hour` when not given.
    dashboard: MetricsHistory | None = None
    recent_requests: RecentRequests = field(default_factory=RecentRequests)
    ready: bool = False
    draining: bool = False
    startup_error: str | None = None
    # Per engine sequence: (last token time, tokens so far, first token time), for the latency metrics.
    _token_clock: dict[tuple[str, int], tuple[float, int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api_key is not None and self.api_key not in self.api_keys:
            self.api_keys = (self.api_key, *self.api_keys)
        if self.dashboard is None:
            self.dashboard = MetricsHistory(
                # With --api-server-count the whole server's values (every process's files).
                registry_source(self.metrics.scrape_registry), self.metrics.prefix, cost_per_hour=self.cost_per_hour
            )

    def engine_started(self) -> None:
        """The engine is up (AsyncEngine.start returned): take its sampling defaults and the model's
        shapes (LoRA checks), and route its reports here (every API server process does this)."""
        self.default_sampling = self.engine.default_sampling
        self.attach_engine()
        if self.lora is not None:
            self.lora.arch = self.engine.arch

    def attach_engine(self) -> None:
        """Route the engine's per-output and per-step reports into this server's metrics and its
        dashboard."""
        self.engine.on_step_stats = self.observe_engine_stats
        self.engine.on_output = self.observe_output
        self.engine.on_finished_sequence = self.recent_requests.record_output
        info = self.engine.info
        if info is not None:
            cache = self.engine.config.cache
            self.metrics.info.set_cache_config(
                block_size=info.block_size, num_gpu_blocks=info.num_kv_blocks, cache_dtype=cache.kv_cache_dtype,
                enable_prefix_caching=cache.enable_prefix_caching, gpu_memory_utilization=cache.gpu_memory_utilization,
                max_model_len=info.max_model_len,
            )  # fmt: skip
        lora = self.lora
        if lora is not None:
            config = self.engine.config.lora
            self.metrics.info.set_lora_load(
                lambda: {a.request.lora_name: lora.num_holding(a.request.lora_name) for a in lora.adapters},
                config.max_loras if config is not None else 0,
            )
            # Several API server processes: in-flight counts go to their shared metrics files.
            lora.on_holds_changed = self.metrics.on_lora_holds_changed

    def observe_engine_stats(self, stats: dict[str, float]) -> None:
        self.metrics.update_engine_stats(stats)
        # The engine reports at least every 0.5 s, so the dashboard's series keep their pace
        # without a task of their own; a snapshot is taken at most every interval.
        if self.dashboard is not None:
            self.dashboard.maybe_sample()

    def trace_context(self, headers: Any, received: float, model: str | None) -> TraceContext | None:
        """What a request's span needs from its HTTP request; None (nothing kept) with tracing off."""
        if self.engine.spans is None:
            return None
        carried = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        return TraceContext(carried, received, model or self.model_names[0])

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len if self.engine.info else 0

    def check_available(self) -> None:
        """Raises 503 (counted as a refusal) unless the server takes new requests."""
        try:
            self._check_available()
        except TokenmillError:
            self.metrics.on_request_rejected("unavailable")
            raise

    def _check_available(self) -> None:
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down and admits no new requests")
        if self.engine.dead:
            raise EngineDeadError(f"the engine is not available: {self.engine.dead}")
        if not self.ready:
            raise ServiceUnavailableError("the engine is still starting; retry once /health answers 200")

    def tokenizer(self, param: str | None = None) -> Any:
        """The model's tokenizer; a 400 naming `param` when the model has none (dummy weights)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; send prompts as token ids to /v1/completions", param=param
            )
        return tokenizer

    def check_model(self, model: str | None) -> None:
        self.resolve_model(model)

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 naming everything
        served when it names nothing served."""
        if model is None or model in self.model_names:
            return None
        lora = self.lora.get(model) if self.lora is not None else None
        if lora is None:
            served = ", ".join(self.model_names)
            if self.lora is not None:
                adapters = ", ".join(a.request.lora_name for a in self.lora.adapters) or "none loaded"
                served = f"{served} (base model); LoRA adapters: {adapters}"
            raise ModelNotFoundError(f"the model {model!r} does not exist; this server serves: {served}", param="model")
        return lora

    def observe_output(self, out: RequestOutput, now: float) -> None:
        """Feeds the latency histograms from every output as it leaves the engine."""
        completion = out.outputs[0]
        key = (out.request_id, completion.index)
        new_tokens = len(completion.token_ids)
        previous = self._token_clock.get(key)
        arrival = out.metrics.get("arrival_time", now)
        if new_tokens:
            if previous is None:
                self.metrics.on_first_token(now - arrival)
                self._token_clock[key] = (now, new_tokens, now)
            else:
                gap = now - previous[0]
                for _ in range(new_tokens):
                    self.metrics.on_token_gap(gap / new_tokens)
                self._token_clock[key] = (now, previous[1] + new_tokens, previous[2])
        if out.finished:
            _, generated, first_token = self._token_clock.pop(key, (now, 0, None))
            if previous is None and not new_tokens:
                generated = 0
            self.metrics.on_request_finished(
                completion.finish_reason or "abort",
                len(out.prompt_token_ids) if completion.index == 0 else 0,
                generated,
                now - arrival,
                out.metrics.get("queue_time"),
                ttft=None if first_token is None else first_token - arrival,
            )


def monotonic() -> float:
    return time.monotonic()
