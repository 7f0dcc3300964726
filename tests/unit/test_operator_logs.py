"""--enable-log-requests lines and the periodic stats line, without a server."""

from __future__ import annotations

import logging
import time

import pytest

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.request_log import RequestLog
from tokenmill.engine.stats_log import StatsLog
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


def test_request_log_cuts_the_prompt_and_reports_the_finish(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.engine.request_log")
    log = RequestLog(max_log_len=5)
    log.arrived("req-1", "abcdefghij", list(range(10)), SamplingParams(temperature=0.3, max_tokens=4), None)
    out = RequestOutput(
        "req-1", "abcdefghij", list(range(10)),
        [CompletionOutput(index=0, text="x", token_ids=[1], finish_reason="length")],
        finished=True, num_cached_tokens=4, metrics={"arrival_time": time.monotonic() - 0.5},
    )  # fmt: skip
    log.finished(out, 4)
    log.abandoned("req-2", 0, 2)
    arrived, finished, abandoned = (r.getMessage() for r in caplog.records)
    assert "Received request req-1: prompt: 'abcde'," in arrived
    assert "prompt_token_ids: [0, 1, 2, 3, 4]," in arrived and "prompt_tokens: 10" in arrived
    assert "temperature=0.3" in arrived and "max_tokens=4" in arrived
    assert "Finished request req-1 (sequence 0): finish_reason: length" in finished
    assert "generated_tokens: 4" in finished and "cached_tokens: 4" in finished
    e2e = float(finished.split("e2e: ")[1].split(" s")[0])
    assert 0.5 <= e2e < 5
    assert "Aborted request req-2" in abandoned and "0 of 2" in abandoned


def test_stats_line_has_throughput_queue_kv_and_prefix_hits():
    stats_log = StatsLog(10.0)
    start = time.monotonic()
    stats_log._last_time = start
    # Two sequences start (prompts of 100 and 60 tokens, 40 of the second cached), then decode.
    stats_log.output(EngineCoreOutput("a", new_token_ids=[1], queue_time=0.1), 100)
    stats_log.output(EngineCoreOutput("b", new_token_ids=[1], queue_time=0.1, num_cached_tokens=40), 60)
    for _ in range(9):
        stats_log.output(EngineCoreOutput("a", new_token_ids=[1, 2]), 100)
    engine = {"num_running": 2, "num_waiting": 3, "kv_cache_usage": 0.25, "prefix_cache_queries": 160, "prefix_cache_hits": 40}
    line = stats_log.line(engine, start + 2.0)
    assert line == (
        "Avg prompt throughput: 60.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 2 reqs, "
        "Waiting: 3 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    # The next interval: only new lookups count for the hit rate; counters restarted.
    engine |= {"prefix_cache_queries": 260, "prefix_cache_hits": 120, "num_running": 0, "num_waiting": 0}
    line = stats_log.line(engine, start + 4.0)
    assert line is not None and "Avg prompt throughput: 0.0" in line and "Prefix cache hit rate: 80.0%" in line
    # Idle: one more line was the idle one; then silence until work comes.
    assert stats_log.line(engine, start + 6.0) is None
    stats_log.output(EngineCoreOutput("c", new_token_ids=[1], queue_time=0.0), 8)
    assert stats_log.line(engine, start + 8.0) is not None


def test_stats_interval_must_be_positive(monkeypatch):
    from tokenmill import envs

    with pytest.raises(ValueError, match="> 0 seconds"):
        StatsLog(0)
    monkeypatch.setenv("TOKENMILL_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="TOKENMILL_LOG_STATS_INTERVAL"):
        envs.TOKENMILL_LOG_STATS_INTERVAL.get()
