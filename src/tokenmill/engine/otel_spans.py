"""OpenTelemetry spans of requests (`--otlp-traces-endpoint`), made in the API server process.

One span `llm_request` (kind SERVER) per engine sequence, built after it finished from times that
exist anyway: the API server's (the HTTP request arrived, tokenized, first output processed,
finished) and the engine's `RequestTimeline` (core/request_timeline.py, sent on the final output
while this is on). Its parent is the caller's span when the HTTP request carried a W3C
`traceparent`, so the request joins the caller's trace. The stages are span events in time order
(`http.received`, `tokenized`, `queued`, `scheduled`, one `prefill_chunk` per chunk, `preempted`,
`first_token`, `api_first_output`, `engine_finished`, `finished`) and three child spans (`queue`,
`prefill`, `decode`) so a trace viewer draws the request's time as a flamegraph. Attributes follow
vLLM's (the gen_ai.* semantic conventions); docs/TRACING.md lists them.

Spans leave through the SDK's BatchSpanProcessor on its own thread: an unreachable collector costs
a logged export error, never a request. Times here are `time.monotonic()` seconds; a span needs
epoch nanoseconds, so each is shifted by the offset between the two clocks.

Nothing here is imported unless tracing is on: `opentelemetry-sdk` is an optional dependency
(`pip install tokenmill[otel]`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request_timeline import RequestTimeline
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
SERVICE_NAME = "tokenmill"
# The W3C trace-context headers read from an incoming request (lower case, as ASGI gives them).
TRACE_HEADERS = ("traceparent", "tracestate")
# Seconds provider.shutdown() may take to push the last spans out at server exit.
SHUTDOWN_FLUSH_MS = 2000


@dataclass(frozen=True, slots=True)
class TraceContext:
    """What the API server knows of a request before the engine sees it."""

    headers: dict[str, str]  # traceparent / tracestate as received (empty: a new trace)
    received: float  # time.monotonic() when its HTTP request reached the route
    model: str  # the served model name it asked for


@dataclass(slots=True)
class _Sequence:
    parent_id: str
    index: int
    params: SamplingParams  # the sequence's own (n=1 after the fan-out)
    n: int  # the user request's n
    prompt_tokens: int
    arrival: float  # stamped after tokenization (the span's "tokenized" stage)
    trace: TraceContext | None
    first_output: float | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None


@dataclass(slots=True)
class _Stage:
    time: float
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)


def _exporter_processor(endpoint: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter ({exc}); "
            "pip install 'tokenmill[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
        ) from None
    # The exporter reads the other OTEL_EXPORTER_OTLP_* variables itself (headers, timeout, TLS).
    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))


class RequestSpans:
    """Follows each sequence from add() to its final output, then exports its span."""

    def __init__(self, endpoint: str | None = None, *, span_processor: Any = None) -> None:
        """`endpoint`: an OTLP/HTTP traces URL; `span_processor`: one to use instead (tests pass a
        SimpleSpanProcessor over an InMemorySpanExporter)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if span_processor is None:
            if endpoint is None:
                raise ValueError("RequestSpans needs an endpoint or a span processor")
            span_processor = _exporter_processor(endpoint)
        # Our own provider, not the global one: an application embedding tokenmill keeps its own.
        # Resource.create also reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
        self._provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self._provider.add_span_processor(span_processor)
        self._tracer = self._provider.get_tracer("tokenmill")
        self._propagator = TraceContextTextMapPropagator()
        self._sequences: dict[str, _Sequence] = {}
        self.endpoint = endpoint

    def add(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        params: SamplingParams,
        prompt_tokens: int,
        arrival: float,
        trace: TraceContext | None,
        n: int = 1,
    ) -> None:
        self._sequences[request_id] = _Sequence(parent_id, index, params, n, prompt_tokens, arrival, trace)

    def output(self, out: EngineCoreOutput, now: float) -> None:
        seq = self._sequences.get(out.request_id)
        if seq is None:
            return
        if out.new_token_ids:
            if seq.first_output is None:
                seq.first_output = now
            seq.num_tokens += len(out.new_token_ids)
        if out.num_cached_tokens:
            seq.num_cached_tokens = out.num_cached_tokens
        if out.queue_time is not None:
            seq.queue_time = out.queue_time
        if out.finished:
            del self._sequences[out.request_id]
            self._export(out.request_id, seq, out.finish_reason or "abort", now, out.timeline, out.error)

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every followed sequence's span ends now with an error status."""
        now = time.monotonic()
        for request_id, seq in list(self._sequences.items()):
            self._export(request_id, seq, "error", now, None, reason)
        self._sequences.clear()

    def shutdown(self) -> None:
        self._provider.force_flush(SHUTDOWN_FLUSH_MS)
        self._provider.shutdown()

    @property
    def num_followed(self) -> int:
        return len(self._sequences)

    # -- one span ------------------------------------------------------------------------------

    def _export(
        self,
        request_id: str,
        seq: _Sequence,
        finish_reason: str,
        finished: float,
        timeline: RequestTimeline | None,
        error: str | None,
    ) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        offset_ns = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        start = seq.trace.received if seq.trace is not None else seq.arrival
        parent = self._propagator.extract(seq.trace.headers) if seq.trace is not None else None
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=ns(start),
            attributes=_attributes(request_id, seq, finish_reason, start, finished, timeline),
        )
        for stage in sorted(_stages(seq, finished, timeline), key=lambda s: s.time):
            span.add_event(stage.name, stage.attributes, timestamp=ns(stage.time))
        inside = set_span_in_context(span)
        for name, begin, end in _phases(timeline):
            self._tracer.start_span(name, context=inside, start_time=ns(begin)).end(end_time=ns(end))
        if finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, error or "the sequence ended with an error"))
        span.end(end_time=ns(finished))


def _first_scheduled(timeline: RequestTimeline | None) -> float | None:
    return timeline.prefill_chunks[0][0] if timeline is not None and timeline.prefill_chunks else None


def _attributes(
    request_id: str,
    seq: _Sequence,
    finish_reason: str,
    start: float,
    finished: float,
    timeline: RequestTimeline | None,
) -> dict[str, Any]:
    params = seq.params
    attrs: dict[str, Any] = {
        "gen_ai.request.id": seq.parent_id,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.n": seq.n,
        "gen_ai.usage.prompt_tokens": seq.prompt_tokens,
        "gen_ai.usage.completion_tokens": seq.num_tokens,
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.latency.e2e": finished - start,
        "tokenmill.sequence_id": request_id,
        "tokenmill.sequence_index": seq.index,
        "tokenmill.cached_tokens": seq.num_cached_tokens,
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k > 0:
        attrs["gen_ai.request.top_k"] = params.top_k
    if seq.trace is not None:
        attrs["gen_ai.response.model"] = seq.trace.model
        attrs["gen_ai.request.model"] = seq.trace.model
    if seq.first_output is not None:
        attrs["gen_ai.latency.time_to_first_token"] = seq.first_output - start
    first_scheduled = _first_scheduled(timeline)
    if timeline is not None:
        attrs["tokenmill.num_preemptions"] = len(timeline.preempted)
        attrs["tokenmill.num_steps"] = timeline.num_steps
    if timeline is not None and first_scheduled is not None:
        attrs["gen_ai.latency.time_in_queue"] = first_scheduled - timeline.received
        engine_end = timeline.finished or finished
        attrs["gen_ai.latency.time_in_model_inference"] = engine_end - first_scheduled
        if timeline.first_token:
            attrs["gen_ai.latency.time_in_model_prefill"] = timeline.first_token - first_scheduled
            attrs["gen_ai.latency.time_in_model_decode"] = engine_end - timeline.first_token
    elif seq.queue_time is not None:
        attrs["gen_ai.latency.time_in_queue"] = seq.queue_time
    return attrs


def _stages(seq: _Sequence, finished: float, timeline: RequestTimeline | None) -> list[_Stage]:
    stages = [_Stage(seq.arrival, "tokenized", {"prompt_tokens": seq.prompt_tokens})]
    if seq.trace is not None:
        stages.append(_Stage(seq.trace.received, "http.received"))
    if timeline is not None:
        stages.append(_Stage(timeline.received, "queued"))
        for i, (when, step, tokens) in enumerate(timeline.prefill_chunks):
            if i == 0:
                stages.append(_Stage(when, "scheduled", {"step": step}))
            stages.append(_Stage(when, "prefill_chunk", {"step": step, "tokens": tokens}))
        stages.extend(_Stage(when, "preempted") for when in timeline.preempted)
        if timeline.first_token:
            stages.append(_Stage(timeline.first_token, "first_token"))
        if timeline.finished:
            stages.append(_Stage(timeline.finished, "engine_finished"))
    if seq.first_output is not None:
        stages.append(_Stage(seq.first_output, "api_first_output"))
    stages.append(_Stage(finished, "finished", {"completion_tokens": seq.num_tokens}))
    return stages


def _phases(timeline: RequestTimeline | None) -> list[tuple[str, float, float]]:
    """The child spans: waiting for the first schedule, the prefill up to the first token, the
    decode up to the engine's end (a preempted request's recompute falls in the decode)."""
    first_scheduled = _first_scheduled(timeline)
    if timeline is None or first_scheduled is None:
        return []
    phases = [("queue", timeline.received, first_scheduled)]
    if timeline.first_token:
        phases.append(("prefill", first_scheduled, timeline.first_token))
        if timeline.finished:
            phases.append(("decode", timeline.first_token, timeline.finished))
    return phases
