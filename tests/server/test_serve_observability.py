"""`tokenmill serve` on a tiny checkpoint with --otlp-traces-endpoint pointing at an in-process
OTLP/HTTP collector, --enable-log-requests and a fast stats line: the span carries the engine's
stages, and the log has the request and stats lines."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pip install tokenmill[otel])")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.server.server_process import start_server  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces endpoint that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        collector.spans.extend(scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_serve_exports_spans_and_logs_requests_and_stats(tmp_path, tiny_llama_dir):
    collector = Collector()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50", "TOKENMILL_LOG_STATS_INTERVAL": "0.5", "OTEL_SERVICE_NAME": "tm-test"}
    proc = start_server(
        str(tmp_path), str(tiny_llama_dir), "--device", "cpu", "--max-model-len", "128",
        "--otlp-traces-endpoint", collector.url, "--enable-log-requests", "--max-log-len", "12", env=env,
    )  # fmt: skip
    try:
        r = httpx.post(
            f"{proc.base_url}/v1/completions",
            json={"prompt": "tracing one request through the engine", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        request_id = r.json()["id"]
        deadline = time.monotonic() + 20
        while not [s for s in collector.spans if s.name == "llm_request"] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.2)  # two stats intervals
        log = proc.log()
    finally:
        proc.stop()
    (span,) = [s for s in collector.spans if s.name == "llm_request"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 6
    assert attrs["gen_ai.request.id"].string_value == f"{request_id}-p0"  # the engine id of prompt 0
    assert attrs["gen_ai.usage.prompt_tokens"].int_value > 0
    assert attrs["gen_ai.latency.time_in_queue"].double_value >= 0
    events = [e.name for e in span.events]
    for stage in ("http.received", "tokenized", "queued", "scheduled", "prefill_chunk", "first_token", "finished"):
        assert stage in events, events
    times = [e.time_unix_nano for e in span.events]
    assert times == sorted(times)
    children = {s.name for s in collector.spans if s.parent_span_id == span.span_id}
    assert children == {"queue", "prefill", "decode"}
    # The logs an operator expects.
    assert f"Received request {request_id}" in log and "prompt: 'tracing one '" in log, log
    assert f"Finished request {request_id}" in log and "generated_tokens: 6" in log, log
    assert "Avg prompt throughput:" in log and "Running: " in log and "KV cache usage:" in log, log
