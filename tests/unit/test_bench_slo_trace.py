"""bench/slo_trace.py: a server trace's request records split into TTFT stages per SLO class."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.slo_trace import format_stages, read_requests, ttft_stages_by_class


def record(priority: int, arrival: float, **fields) -> dict:
    base = {"kind": "request", "id": f"r{arrival}", "priority": priority, "arrival": arrival}
    return base | fields


def test_stages_by_class_from_the_trace_file(tmp_path) -> None:
    records = [
        # Before the run: ignored.
        record(0, 5.0, received=5.1, prefill_chunks=[[5.2, 0, 8]], first_token=5.3, finished=5.5, output_tokens=3),
        # Class 0: 0.1 s to the engine, 0.2 s queued, 0.3 s prefill; 4 tokens over 0.6 s after the first.
        record(
            0, 10.0, received=10.1, prefill_chunks=[[10.3, 1, 8]], first_token=10.6, finished=11.2,
            output_tokens=4, preempted=[10.9], finish_reason="length",
        ),  # fmt: skip
        record(1, 10.5, finish_reason="shed"),  # shed before any step: no stages
        {"kind": "gc", "start": 10.7, "seconds": 0.01, "generation": 2},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    read = read_requests(str(tmp_path), since=9.0)
    assert [r["arrival"] for r in read] == [10.0, 10.5]
    report = ttft_stages_by_class(read)
    high, low = report["0"], report["1"]
    assert high["requests"] == 1 and high["shed"] == 0
    assert high["preempted_requests"] == 1 and high["preemptions"] == 1
    for stage, ms in (("to_engine", 100), ("queued", 200), ("prefill", 300), ("ttft", 600), ("tpot", 200)):
        assert high[f"{stage}_p50_ms"] == pytest.approx(ms), stage
    assert low == {"requests": 1, "shed": 1, "preempted_requests": 0, "preemptions": 0}
    assert "class 1: 1 requests, 1 shed" in format_stages(report)
    assert read_requests(str(tmp_path / "missing"), since=0.0) == []
