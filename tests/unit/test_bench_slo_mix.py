"""`bench serve`'s SLO classes: the priority mix, and attainment / goodput from client-side times."""

from __future__ import annotations

import pytest

from tokenmill.bench.serve_metrics import RequestResult
from tokenmill.bench.slo_mix import assign_priorities, parse_priority_mix, slo_report


def done(ttft: float, latency: float, tokens: int) -> RequestResult:
    return RequestResult(success=True, ttft=ttft, latency=latency, output_tokens=tokens)


def test_priority_mix_is_parsed_checked_and_drawn_reproducibly() -> None:
    mix = parse_priority_mix("0:0.3, 1:0.7")
    assert mix == [(0, 0.3), (1, 0.7)]
    drawn = assign_priorities(2000, mix, seed=1)
    assert drawn == assign_priorities(2000, mix, seed=1)
    assert 0.25 < drawn.count(0) / 2000 < 0.35
    for bad in ("0", "0:0", "x:1", ""):
        with pytest.raises(ValueError, match="priority-mix"):
            parse_priority_mix(bad)


def test_attainment_counts_ttft_tpot_and_429s_per_class() -> None:
    results = [
        done(0.5, 1.5, 11),  # prio 0: TTFT 500 ms, TPOT 100 ms: met (1000/200)
        done(1.5, 2.0, 11),  # prio 0: TTFT too late
        done(0.5, 5.5, 11),  # prio 0: TPOT 500 ms, too slow
        RequestResult(error="HTTP 429: shed by the SLO scheduler"),  # prio 0
        done(4.0, 5.0, 2),  # prio 1: TTFT 4 s within 5 s; TPOT has no target
    ]
    report = slo_report(results, [0, 0, 0, 0, 1], "0=1000/200,1=5000/", duration_s=2.0)
    hi, lo = report["classes"]["0"], report["classes"]["1"]
    assert (hi["sent"], hi["completed"], hi["rejected_429"], hi["met"]) == (4, 3, 1, 1)
    assert hi["attainment"] == 0.25 and (hi["ttft_target_ms"], hi["tpot_target_ms"]) == (1000, 200)
    assert lo["met"] == 1 and lo["tpot_target_ms"] is None
    assert report["goodput_requests"] == 2 and report["goodput_rps"] == 1.0
