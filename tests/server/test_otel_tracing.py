"""OpenTelemetry spans (--otlp-traces-endpoint): built from the timelines, joined to the caller's
trace, over the real API server code with the fake engine; off by default; a dead collector costs
nothing but log lines."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pip install tokenmill[otel])")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state, serve_over_fake_engine, wait_until  # noqa: E402
from tests.server.server_process import free_port  # noqa: E402
from tokenmill.args import EngineArgs, resolve_otlp_traces_endpoint  # noqa: E402
from tokenmill.core.outputs import EngineCoreOutput  # noqa: E402
from tokenmill.core.request_timeline import RequestTimeline  # noqa: E402
from tokenmill.engine.otel_spans import SPAN_NAME, RequestSpans, TraceContext  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def in_memory_spans() -> tuple[RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return RequestSpans(span_processor=SimpleSpanProcessor(exporter)), exporter


def test_span_from_a_timeline_has_the_parent_attributes_and_ordered_stages():
    spans, exporter = in_memory_spans()
    t0 = time.monotonic()
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=7)
    trace = TraceContext({"traceparent": TRACEPARENT}, received=t0, model="m")
    spans.add("r-0", "r", 0, params, prompt_tokens=30, arrival=t0 + 0.01, trace=trace)
    timeline = RequestTimeline(
        arrival=t0 + 0.01,
        received=t0 + 0.02,
        prompt_tokens=30,
        prefill_chunks=[(t0 + 0.05, 3, 16), (t0 + 0.06, 4, 14), (t0 + 0.20, 9, 31)],
        first_token=t0 + 0.07,
        preempted=[t0 + 0.15],
        finished=t0 + 0.30,
        num_steps=12,
    )
    spans.output(EngineCoreOutput("r-0", new_token_ids=[5], queue_time=0.03), t0 + 0.08)
    spans.output(EngineCoreOutput("r-0", new_token_ids=[6, 7]), t0 + 0.2)
    spans.output(EngineCoreOutput("r-0", new_token_ids=[8], finish_reason="length", timeline=timeline), t0 + 0.31)
    assert spans.num_followed == 0

    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {SPAN_NAME, "queue", "prefill", "decode"}
    span = by_name[SPAN_NAME]
    assert span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    for child in ("queue", "prefill", "decode"):
        assert by_name[child].parent.span_id == span.context.span_id
        assert by_name[child].context.trace_id == span.context.trace_id
    attrs = span.attributes
    assert attrs["gen_ai.request.id"] == "r"
    assert attrs["gen_ai.response.model"] == "m"
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.usage.prompt_tokens"] == 30
    assert attrs["gen_ai.usage.completion_tokens"] == 4
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.08, abs=1e-6)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(0.31, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.03, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.02, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.23, abs=1e-6)
    assert attrs["tokenmill.num_preemptions"] == 1
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    names = [e.name for e in span.events]
    assert names == [
        "http.received", "tokenized", "queued", "scheduled", "prefill_chunk", "prefill_chunk",
        "first_token", "api_first_output", "preempted", "prefill_chunk", "engine_finished", "finished",
    ]  # fmt: skip
    stamps = [e.timestamp for e in span.events]
    assert stamps == sorted(stamps)
    assert span.start_time == stamps[0] and span.end_time == stamps[-1]
    # Monotonic times became wall-clock times: within a second of now.
    assert abs(span.end_time - time.time_ns()) < 1e9
    assert [e.attributes["tokens"] for e in span.events if e.name == "prefill_chunk"] == [16, 14, 31]


def test_without_a_traceparent_the_span_starts_a_trace_and_errors_are_marked():
    spans, exporter = in_memory_spans()
    now = time.monotonic()
    spans.add("a-0", "a", 0, SamplingParams(), 3, now, TraceContext({}, now, "m"))
    spans.output(EngineCoreOutput("a-0", finish_reason="error", error="NaN logits"), now + 0.1)
    spans.add("b-0", "b", 0, SamplingParams(), 3, now, None)
    spans.fail_all("the engine died")
    a, b = exporter.get_finished_spans()
    assert a.parent is None and a.status.status_code == StatusCode.ERROR and "NaN" in a.status.description
    assert b.status.description == "the engine died" and b.attributes["gen_ai.request.id"] == "b"
    assert a.context.trace_id != b.context.trace_id


def _serve_fake(engine: FakeEngine, scenario) -> None:
    serve_over_fake_engine(lambda client, _state, _engine: scenario(client), timeout=10, engine=engine)


def _request_spans(exporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == "llm_request"]


def test_the_request_span_joins_the_callers_trace_through_the_api():
    engine = FakeEngine()
    engine.spans, exporter = in_memory_spans()

    async def scenario(client: httpx.AsyncClient) -> None:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2},
            headers={"traceparent": TRACEPARENT, "tracestate": "k=v"},
        )
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        await wait_until(lambda: len(_request_spans(exporter)) == 3)

    _serve_fake(engine, scenario)
    requests = _request_spans(exporter)
    # The fake engine sends timelines, so each request span also has queue / prefill / decode children.
    assert {s.parent.span_id for s in exporter.get_finished_spans() if s.name != "llm_request"} == {
        s.context.span_id for s in requests
    }
    chat = [s for s in requests if s.attributes["gen_ai.usage.completion_tokens"] == 5]
    assert sorted(s.attributes["tokenmill.sequence_index"] for s in chat) == [0, 1]
    for span in chat:
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
        assert span.context.trace_state.get("k") == "v"
        assert span.attributes["gen_ai.request.n"] == 2 and span.attributes["gen_ai.request.max_tokens"] == 5
        assert span.attributes["gen_ai.response.model"] == MODEL
    (plain,) = [s for s in requests if s not in chat]
    assert plain.parent is None and plain.attributes["gen_ai.usage.completion_tokens"] == 3
    assert [e.name for e in plain.events][:2] == ["http.received", "tokenized"]
    assert engine.spans.num_followed == 0


def test_tracing_is_off_by_default_and_keeps_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert EngineArgs().create_engine_config(resolve_device=False).otlp_traces_endpoint is None
    engine = FakeEngine()
    try:
        assert engine.spans is None
        state = fake_server_state(engine)
        assert state.trace_context({"traceparent": TRACEPARENT}, 0.0, None) is None
    finally:
        asyncio.run(engine.shutdown())  # closes its sockets (a leaked zmq context blocks a later GC)
    # The API server imports no OpenTelemetry SDK unless tracing is on.
    code = (
        "import sys, tokenmill.server.launch, tokenmill.server.api_server, tokenmill.engine.async_engine;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_endpoint_comes_from_the_flag_or_the_standard_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert resolve_otlp_traces_endpoint(None) == "http://collector:4318/v1/traces"
    assert resolve_otlp_traces_endpoint("https://x:1/v1/traces") == "https://x:1/v1/traces"
    with pytest.raises(ValueError, match="http\\(s\\) URL of an OTLP/HTTP collector"):
        resolve_otlp_traces_endpoint("localhost:4317")


def test_an_unreachable_collector_does_not_disturb_serving(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    endpoint = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    engine = FakeEngine()
    engine.spans = RequestSpans(endpoint)

    async def scenario(client: httpx.AsyncClient) -> None:
        for _ in range(3):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        await asyncio.sleep(0.3)  # the exporter thread tries (and fails) meanwhile

    started = time.monotonic()
    _serve_fake(engine, scenario)
    assert time.monotonic() - started < 8, "shutting down waited on the dead collector too long"


def test_serve_flags_reach_the_engine_and_the_logs(monkeypatch):
    from tests.server.test_serve_args import build

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}/v1/traces"
    server, config = build(["--otlp-traces-endpoint", url, "--enable-log-requests", "--max-log-len", "5"])
    engine = server.tm_state.engine
    assert config.otlp_traces_endpoint == url and engine.spans is not None and engine.spans.endpoint == url
    assert engine.request_log is not None and engine.request_log.max_log_len == 5
    assert engine.stats_log is not None and engine.stats_log.interval_s == 10.0
    server, config = build(["--disable-log-stats"])
    engine = server.tm_state.engine
    assert config.otlp_traces_endpoint is None and engine.spans is None
    assert engine.request_log is None and engine.stats_log is None
    with pytest.raises(ValueError, match="add --enable-log-requests"):
        build(["--max-log-len", "5"])
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        build(["--otlp-traces-endpoint", "localhost:4317"])


def test_the_offline_llm_refuses_an_otlp_endpoint_it_would_not_use():
    from tokenmill.engine.llm import LLM

    with pytest.raises(ValueError, match="otlp_traces_endpoint: the offline LLM exports no spans"):
        LLM(None, otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
