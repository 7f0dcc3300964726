"""bench/tail.py: the client's results joined with a server trace, on a planted slow request."""

from __future__ import annotations

import json

from tokenmill.bench.serve_metrics import RequestResult
from tokenmill.bench.tail import TTFT_STAGES, format_tail, tail_report


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _scenario(tmp_path, slow_compile: bool = True):
    """100 requests 50 ms apart, each prefilled in one 10 ms step of a serial engine; request 42
    arrives during a 900 ms step (a JIT compile), and the requests after it queue behind it."""
    results, requests, steps = [], [], []
    step, engine_free = 0, 0.0
    for i in range(100):
        sent = 1000.0 + 0.05 * i
        arrival, received = sent + 0.002, sent + 0.003
        if i == 42:
            compiles = [["_paged_attention_kernel", received, 0.88]] if slow_compile else []
            steps.append({"step": step, "start": received, "scheduled": received, "launched": received + 0.899,
                          "done": received + 0.9, "tokens": 3, "reqs": 3, "new_reqs": 0, "prefill_tokens": 0,
                          "max_query_len": 1, "running": 3, "waiting": 1, "graph": 4, "compiles": compiles,
                          "gc": [[received, 0.004, 2]]})  # fmt: skip
            step += 1
            engine_free = received + 0.9
        start = max(received, engine_free)
        first_token = engine_free = start + 0.010
        steps.append({"step": step, "start": start, "scheduled": start, "launched": start + 0.001,
                      "done": first_token, "tokens": 64, "reqs": 1, "new_reqs": 1, "prefill_tokens": 64,
                      "max_query_len": 64, "running": 1, "waiting": 0, "graph": 0, "compiles": [], "gc": []})  # fmt: skip
        step += 1
        api_first = first_token + 0.001
        ttft = api_first + 0.002 - sent
        requests.append({"kind": "request", "id": f"cmpl-{i}-p0", "finish_reason": "length", "arrival": arrival,
                         "received": received, "prompt_tokens": 64, "prefill_chunks": [[start, step - 1, 64]],
                         "first_token": first_token, "finished": first_token + 0.02, "num_steps": 3,
                         "api_first_output": api_first, "api_finished": first_token + 0.021})  # fmt: skip
        results.append(RequestResult(success=True, prompt_len=64, output_tokens=3, ttft=ttft, latency=ttft + 0.02,
                                     sent_monotonic=sent, response_id=f"cmpl-{i}"))  # fmt: skip
    requests.append({"kind": "gc", "start": 1001.0, "seconds": 0.05, "generation": 2})
    _write(tmp_path / "requests.jsonl", requests)
    _write(tmp_path / "steps.jsonl", steps)
    return results


def test_the_slowest_request_is_split_into_stages_and_blamed_on_its_compile(tmp_path):
    report = tail_report(_scenario(tmp_path), str(tmp_path))
    assert report["requests_traced"] == 100 and report["requests_untraced"] == 0
    (worst,) = report["slowest_ttft"]  # 1 % of 100
    assert worst["id"] == "cmpl-42"
    stages = worst["stages_ms"]
    assert set(stages) == set(TTFT_STAGES)
    assert abs(sum(stages.values()) - worst["ttft_ms"]) < 0.01  # the stages add up to the TTFT
    assert abs(stages["queued"] - 900.0) < 0.01 and abs(stages["prefill"] - 10.0) < 0.01
    waited = worst["while_waiting"]
    assert waited["jit_compiles"] == 1 and waited["jit_kernels"] == ["_paged_attention_kernel"]
    assert abs(waited["gc_pause_ms"] - 4.0) < 1e-6 and waited["longest_step_gap_ms"] > 850
    assert report["ttft_stage_ms_p50_all"]["queued"] < 1.0  # the median request did not wait
    assert report["steps"]["jit_compiles"] == 1 and report["api_gc_pauses"] == 1
    text = format_tail(report)
    assert "queued" in text and "1 JIT compiles" in text


def test_requests_missing_from_the_trace_are_counted_not_guessed(tmp_path):
    results = _scenario(tmp_path, slow_compile=False)
    results[0].response_id = "cmpl-not-traced"
    report = tail_report(results, str(tmp_path))
    assert report["requests_untraced"] == 1 and report["slowest_ttft"][0]["while_waiting"]["jit_compiles"] == 0
    assert "error" in tail_report(results, str(tmp_path / "elsewhere"))
