"""The dashboard's arithmetic: histogram quantiles over a window (Prometheus' histogram_quantile),
counter increases across restarts, rates, cost per million tokens, and the points MetricsHistory
builds from a real registry sampled on a fake clock."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmill.dashboard import MetricsHistory, registry_source, text_source
from tokenmill.dashboard.snapshot import HistogramCounts, take_snapshot
from tokenmill.dashboard.window import (
    cost_per_million_tokens,
    histogram_delta,
    histogram_quantile,
    increase,
    rate,
)
from tokenmill.metrics import ServerMetrics

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_holding_the_rank() -> None:
    # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 in (2, 4].
    h = HistogramCounts([1.0, 2.0, 4.0, INF], [4.0, 8.0, 10.0, 10.0])
    assert histogram_quantile(0.5, h) == pytest.approx(1.25)  # rank 5: 1 of 4 into (1, 2]
    assert histogram_quantile(0.2, h) == pytest.approx(0.5)  # rank 2 of 4 in (0, 1]
    assert histogram_quantile(0.9, h) == pytest.approx(3.0)  # rank 9: half of (2, 4]
    assert histogram_quantile(1.0, h) == pytest.approx(4.0)


def test_quantile_in_the_inf_bucket_is_the_largest_finite_bound_and_empty_is_none() -> None:
    h = HistogramCounts([1.0, 2.0, INF], [1.0, 1.0, 5.0])
    assert histogram_quantile(0.99, h) == 2.0
    assert histogram_quantile(0.5, HistogramCounts([1.0, INF], [0.0, 0.0])) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        histogram_quantile(1.5, h)


def test_quantile_matches_sorted_observations_for_a_fine_histogram() -> None:
    bounds = [i / 100 for i in range(1, 101)] + [INF]
    values = [((i * 37) % 100 + 0.5) / 100 for i in range(1000)]  # spread over (0, 1)
    counts = [float(sum(v <= b for v in values)) for b in bounds]
    exact = sorted(values)
    for q in (0.5, 0.9, 0.99):
        assert histogram_quantile(q, HistogramCounts(bounds, counts)) == pytest.approx(exact[int(q * 1000) - 1], abs=0.011)


def test_delta_and_increase_survive_a_restart() -> None:
    old = HistogramCounts([1.0, INF], [3.0, 5.0], 4.0)
    new = HistogramCounts([1.0, INF], [4.0, 9.0], 10.0)
    d = histogram_delta(new, old)
    assert d.counts == [1.0, 4.0] and d.sum == 6.0 and d.count == 4.0
    restarted = HistogramCounts([1.0, INF], [1.0, 1.0], 0.5)
    assert histogram_delta(restarted, old) is restarted
    assert increase(12.0, 10.0) == 2.0 and increase(3.0, 10.0) == 3.0 and increase(7.0, None) == 7.0
    assert rate(30.0, 10.0, 4.0) == 5.0 and rate(30.0, 10.0, 0.0) == 0.0


def test_cost_per_million_tokens() -> None:
    # $3.60 an hour at 1000 tok/s: 3.6 M tokens an hour, so $1 per million.
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(2.0, 50.0) == pytest.approx(2.0 / (50 * 3600) * 1e6)
    assert cost_per_million_tokens(None, 1000.0) is None
    assert cost_per_million_tokens(3.6, 0.0) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_history_points_cover_the_window_from_a_server_registry() -> None:
    metrics = ServerMetrics("m")
    clock = FakeClock()
    history = MetricsHistory(
        registry_source(metrics.registry), "tokenmill:", interval_s=1.0, window_s=4.0,
        cost_per_hour=7.2, clock=clock, wall_clock=lambda: 1_000_000.0 + clock.now,
    )  # fmt: skip
    history.sample()
    assert list(history.points) == []  # one snapshot is no window
    # Old requests, before the window the last point covers: slow ones.
    for _ in range(10):
        metrics.on_first_token(5.0)
    metrics.on_request_finished("stop", prompt_tokens=100, generation_tokens=50, e2e=9.0, queue_time=1.0, ttft=5.0)
    clock.now += 1.0
    history.sample()
    for step in range(4):  # four more seconds: fast requests, 200 output tokens a second
        clock.now += 1.0
        for _ in range(10):
            metrics.on_first_token(0.05)
        metrics.on_request_finished("length", prompt_tokens=10, generation_tokens=200, e2e=1.0, queue_time=0.01, ttft=0.05)
        metrics.update_engine_stats({"num_running": 3, "num_waiting": step, "kv_cache_usage": 0.25,
                                     "prefix_cache_queries": 100 * (step + 1), "prefix_cache_hits": 40 * (step + 1),
                                     "num_preemptions_total": step})  # fmt: skip
        assert history.maybe_sample()
        assert not history.maybe_sample()  # within the interval: nothing new
    last = history.points[-1]
    assert last["window_s"] == pytest.approx(4.0)
    # The window (t=101..105) holds only the fast first tokens (0.05 s in the (0.04, 0.06] bucket).
    assert 0.04 < last["ttft_p50"] <= 0.06 and 0.04 < last["ttft_p99"] <= 0.06
    assert 2.5 < history.points[0]["ttft_p50"] <= 5.0  # the first window saw the slow ones (bucket (2.5, 5])
    assert last["output_tps"] == pytest.approx(200.0)
    assert last["prompt_tps"] == pytest.approx(10.0)
    assert last["requests_ps"] == pytest.approx(1.0)
    assert (last["running"], last["waiting"], last["kv_usage"]) == (3.0, 3.0, 0.25)
    assert last["prefix_hit_rate"] == pytest.approx(0.4)
    assert last["preemptions"] == 3.0
    assert last["spec_acceptance"] is None  # no speculation: no number, not 0
    assert last["cost_per_m_output"] == pytest.approx(7.2 / (200 * 3600) * 1e6)
    assert 0.0025 < last["tpot_p50"] <= 0.005  # (1.0 - 0.05) / 199 = 4.8 ms per token
    totals = history.totals()
    assert totals["requests_finished"] == 5 and totals["output_tokens"] == 850 and totals["prompt_tokens"] == 140
    assert totals["finished_by_reason"]["length"] == 4 and totals["finished_by_reason"]["stop"] == 1
    assert totals["cost_per_m_output_overall"] == pytest.approx(7.2 / (850 / 5.0 * 3600) * 1e6)
    assert len(history.points_since(history.points[-2]["t"])) == 1


def test_history_over_text_and_the_vllm_prefix() -> None:
    metrics = ServerMetrics("m", prefix="vllm:")
    metrics.on_request_finished("stop", prompt_tokens=3, generation_tokens=4, e2e=1.0)
    snapshot = take_snapshot(text_source(lambda: metrics.render().decode())(), "vllm:", 0.0, 0.0)
    assert snapshot.value("generation_tokens_total") == 4
    assert snapshot.histograms["e2e_request_latency_seconds"].count == 1
    assert "e2e_request_latency_seconds" not in take_snapshot(metrics.registry.collect(), "tokenmill:", 0, 0).histograms


def test_history_refuses_a_window_shorter_than_its_interval() -> None:
    with pytest.raises(ValueError, match="interval_s <= window_s"):
        MetricsHistory(CollectorRegistry().collect, "x:", interval_s=5.0, window_s=1.0)


def test_labelled_series_sum_and_split() -> None:
    registry = CollectorRegistry()
    c = Counter("p:lora_hits", "doc", ["model_name", "lora_name"], registry=registry)
    c.labels("m", "a").inc(2)
    c.labels("m", "b").inc(3)
    h = Histogram("p:lat", "doc", ["model_name"], buckets=(1.0,), registry=registry)
    h.labels("m").observe(0.5)
    s = take_snapshot(registry.collect(), "p:", 0.0, 0.0)
    assert s.value("lora_hits_total") == 5 and s.labeled["lora_hits_total"] == {"a": 2.0, "b": 3.0}
    assert s.histograms["lat"].counts == [1.0, 1.0] and s.histograms["lat"].sum == 0.5
