"""bench/saturation.py: output tok/s while a capped run kept the server full."""

from __future__ import annotations

import pytest

from tokenmill.bench.saturation import saturated_window
from tokenmill.bench.serve_metrics import RequestResult


def _request(start: float, ttft: float, gaps: list[float], tokens: int | None = None) -> RequestResult:
    r = RequestResult(success=True, prompt_len=8)
    r.start_time = start
    r.ttft = ttft
    r.itl = list(gaps)
    r.latency = ttft + sum(gaps)
    r.output_tokens = tokens if tokens is not None else 1 + len(gaps)
    return r


def test_window_runs_from_the_cap_reached_to_the_last_send_and_counts_tokens_inside() -> None:
    # Cap 2. Request a: sent at 0, tokens at 1, 2, 3, 4. b: sent at 1 (cap reached), tokens at
    # 2, 3, 4, 5. c: sent at 4 when a ends (last send), tokens at 5, 6. Window [1, 4): tokens of a
    # at 1, 2, 3 and of b at 2, 3 -> 5 tokens over 3 s, two in flight throughout.
    results = [
        _request(0.0, 1.0, [1.0, 1.0, 1.0]),
        _request(1.0, 1.0, [1.0, 1.0, 1.0]),
        _request(4.0, 1.0, [1.0]),
    ]
    window = saturated_window(results, 2)
    assert window is not None
    assert window["window_start_s"] == pytest.approx(1.0)
    assert window["window_end_s"] == pytest.approx(4.0)
    assert window["output_tokens"] == pytest.approx(5.0)
    assert window["output_throughput"] == pytest.approx(5.0 / 3.0)
    assert window["mean_in_flight"] == pytest.approx(2.0)


def test_tokens_of_a_many_token_chunk_are_spread_over_the_request_chunks() -> None:
    # Two chunks carrying 8 tokens: 4 per chunk; only the first chunk (at 1.5) is in [0.5, 2).
    results = [_request(0.0, 1.0, [5.0], tokens=4), _request(0.5, 1.0, [1.0], tokens=8), _request(2.0, 1.0, [])]
    window = saturated_window(results, 2)
    assert window is not None
    assert (window["window_start_s"], window["window_end_s"]) == (0.5, 2.0)
    # a's chunk at 1.0 (2 tokens each) and b's first chunk at 1.5 (4 tokens).
    assert window["output_tokens"] == pytest.approx(2.0 + 4.0)


def test_no_window_without_a_cap_or_when_the_cap_is_never_reached() -> None:
    results = [_request(0.0, 0.1, [0.1]), _request(1.0, 0.1, [0.1])]
    assert saturated_window(results, None) is None
    assert saturated_window(results, 2) is None  # never two in flight
    # A seat refilled the instant another ends is not two in flight at once.
    back_to_back = [_request(0.0, 0.5, [0.5]), _request(1.0, 0.5, [0.5]), _request(2.0, 0.5, [])]
    assert saturated_window(back_to_back, 2) is None
