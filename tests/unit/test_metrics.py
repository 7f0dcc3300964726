"""Prometheus collectors: names, labels, request observations and engine-total deltas."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": metrics.model_name, **labels}.items())))
    return samples(metrics)[key]


def test_exports_vllm_names_with_prefix() -> None:
    m = ServerMetrics("smol")
    names = {name for name, _ in samples(m)}
    for expected in (
        "tokenmill:request_success_total",
        "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total",
        "tokenmill:time_to_first_token_seconds_count",
        "tokenmill:inter_token_latency_seconds_bucket",
        "tokenmill:e2e_request_latency_seconds_sum",
        "tokenmill:request_queue_time_seconds_count",
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:prefix_cache_queries_total",
        "tokenmill:prefix_cache_hits_total",
        "tokenmill:num_preemptions_total",
    ):
        assert expected in names, expected
    assert not any(name.endswith("_created") for name in names)
    for reason in ("stop", "length", "abort", "error"):
        assert value(m, "tokenmill:request_success_total", finished_reason=reason) == 0


def test_two_servers_in_one_process_do_not_collide() -> None:
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.on_first_token(0.1)
    assert value(a, "tokenmill:time_to_first_token_seconds_count") == 1
    assert value(b, "tokenmill:time_to_first_token_seconds_count") == 0


def test_request_observations() -> None:
    m = ServerMetrics("smol")
    m.on_first_token(0.2)
    for gap in (0.01, 0.03):
        m.on_token_gap(gap)
    m.on_request_finished("stop", prompt_tokens=10, generation_tokens=3, e2e=0.5, queue_time=0.05)
    m.on_request_finished("abort", prompt_tokens=4, generation_tokens=1, e2e=2.0)  # no queue time known
    assert value(m, "tokenmill:request_success_total", finished_reason="stop") == 1
    assert value(m, "tokenmill:request_success_total", finished_reason="abort") == 1
    assert value(m, "tokenmill:prompt_tokens_total") == 14
    assert value(m, "tokenmill:generation_tokens_total") == 4
    assert value(m, "tokenmill:inter_token_latency_seconds_count") == 2
    assert abs(value(m, "tokenmill:inter_token_latency_seconds_sum") - 0.04) < 1e-9
    assert value(m, "tokenmill:e2e_request_latency_seconds_count") == 2
    assert value(m, "tokenmill:request_queue_time_seconds_count") == 1
    # TTFT 0.2 s falls in the 0.25 bucket and not the 0.1 one.
    assert value(m, "tokenmill:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(m, "tokenmill:time_to_first_token_seconds_bucket", le="0.25") == 1


def test_engine_totals_become_counter_deltas_and_gauges() -> None:
    m = ServerMetrics("smol")
    m.update_engine_stats(
        {
            "num_running": 3,
            "num_waiting": 5,
            "kv_cache_usage": 0.25,
            "prefix_cache_queries": 100,
            "prefix_cache_hits": 40,
            "num_preemptions_total": 1,
        }
    )
    m.update_engine_stats({"prefix_cache_queries": 150, "prefix_cache_hits": 40, "num_running": 2})
    assert value(m, "tokenmill:prefix_cache_queries_total") == 150
    assert value(m, "tokenmill:prefix_cache_hits_total") == 40
    assert value(m, "tokenmill:num_preemptions_total") == 1
    assert value(m, "tokenmill:num_requests_running") == 2
    assert value(m, "tokenmill:num_requests_waiting") == 5  # missing key: unchanged
    assert value(m, "tokenmill:kv_cache_usage_perc") == 0.25
    # An engine restart resets its totals: the new total counts in full, the counter never drops.
    m.update_engine_stats({"prefix_cache_queries": 30})
    assert value(m, "tokenmill:prefix_cache_queries_total") == 180
    m.update_engine_stats({"prefix_cache_queries": 35})
    assert value(m, "tokenmill:prefix_cache_queries_total") == 185


def test_structured_output_engine_histograms_are_exported_with_their_buckets() -> None:
    from tokenmill.stats_histogram import StatsHistogram

    compile_ = StatsHistogram("structured_output_compile_seconds", (0.01, 0.1, 1.0))
    mask = StatsHistogram("structured_output_mask_seconds", (0.001, 0.01))
    metrics = ServerMetrics("m")
    text = metrics.render().decode()
    assert "tokenmill:structured_output_compile_seconds_count" not in text  # nothing observed yet
    for value in (0.005, 0.05, 0.5):
        compile_.observe(value)
    for value in (0.0005,) * 9 + (0.005,):
        mask.observe(value)
    metrics.update_engine_stats(compile_.stats() | mask.stats())
    metrics.update_engine_stats({"num_running": 0})  # a report without them keeps the last values
    text = metrics.render().decode()
    for line in (
        'tokenmill:structured_output_compile_seconds_bucket{le="0.01",model_name="m"} 1.0',
        'tokenmill:structured_output_compile_seconds_bucket{le="0.1",model_name="m"} 2.0',
        'tokenmill:structured_output_compile_seconds_bucket{le="+Inf",model_name="m"} 3.0',
        'tokenmill:structured_output_compile_seconds_count{model_name="m"} 3.0',
        'tokenmill:structured_output_compile_seconds_sum{model_name="m"} 0.555',
        'tokenmill:structured_output_mask_seconds_bucket{le="0.001",model_name="m"} 9.0',
        'tokenmill:structured_output_mask_seconds_count{model_name="m"} 10.0',
    ):
        assert line in text, (line, text)


def test_spec_decode_counters_appear_only_when_the_engine_reports_them() -> None:
    m = ServerMetrics("smol")
    m.update_engine_stats({"num_running": 1, "prefix_cache_queries": 10})  # speculation off
    assert not any("spec_decode" in name for name, _ in samples(m))
    per_pos = "spec_decode_num_accepted_tokens_per_pos"
    m.update_engine_stats(
        {
            "spec_decode_num_drafts": 10.0,
            "spec_decode_num_draft_tokens": 40.0,
            "spec_decode_num_accepted_tokens": 25.0,
            f"{per_pos}.0": 9.0,
            f"{per_pos}.1": 7.0,
            f"{per_pos}.2": 5.0,
            f"{per_pos}.3": 4.0,
        }
    )
    m.update_engine_stats(
        {
            "spec_decode_num_drafts": 12.0,
            "spec_decode_num_draft_tokens": 48.0,
            "spec_decode_num_accepted_tokens": 29.0,
            f"{per_pos}.0": 11.0,
            f"{per_pos}.1": 8.0,
            f"{per_pos}.2": 6.0,
            f"{per_pos}.3": 4.0,
        }
    )
    assert value(m, "tokenmill:spec_decode_num_drafts_total") == 12
    assert value(m, "tokenmill:spec_decode_num_draft_tokens_total") == 48
    assert value(m, "tokenmill:spec_decode_num_accepted_tokens_total") == 29
    per_position = [value(m, f"tokenmill:{per_pos}_total", position=str(i)) for i in range(4)]
    assert per_position == [11, 8, 6, 4]
    # A report without them (a step with no stats of the kind) leaves them; a restart counts anew.
    m.update_engine_stats({"num_running": 0})
    m.update_engine_stats({"spec_decode_num_drafts": 3.0, f"{per_pos}.0": 2.0})
    assert value(m, "tokenmill:spec_decode_num_drafts_total") == 15
    assert value(m, f"tokenmill:{per_pos}_total", position="0") == 13
    assert value(m, f"tokenmill:{per_pos}_total", position="1") == 8


def test_kv_offload_series_appear_once_the_engine_reports_them() -> None:
    m = ServerMetrics("smol")
    assert not any("kv_offload" in name for name, _ in samples(m))
    m.update_engine_stats({"kv_offload_hits": 64, "kv_offload_blocks_stored": 5, "kv_offload_bytes": 4096})
    m.update_engine_stats({"kv_offload_hits": 96, "kv_offload_blocks_stored": 5, "kv_offload_bytes": 2048})
    assert value(m, "tokenmill:kv_offload_hits_total") == 96
    assert value(m, "tokenmill:kv_offload_blocks_stored_total") == 5
    assert value(m, "tokenmill:kv_offload_bytes") == 2048


def test_the_shared_token_gap_histogram_exports_what_two_prometheus_histograms_would() -> None:
    """Inter-token latency is observed once a token and exported under both vLLM names: the same
    samples as prometheus_client Histograms with those buckets (edges inclusive, +Inf, sum)."""
    from prometheus_client import CollectorRegistry, Histogram

    from tokenmill.metrics import ITL_BUCKETS

    m = ServerMetrics("smol")
    reference = CollectorRegistry()
    names = ("inter_token_latency_seconds", "time_per_output_token_seconds")
    plain = [Histogram("tokenmill:" + n, "doc", ["model_name"], buckets=ITL_BUCKETS, registry=reference) for n in names]
    for gap in (0.0, 0.001, 0.0011, 0.0025, 0.03, 0.0300001, 5.0, 79.9, 80.0, 1e9):
        m.on_token_gap(gap)
        for h in plain:
            h.labels("smol").observe(gap)
    from prometheus_client import generate_latest

    expected = {}
    for family in text_string_to_metric_families(generate_latest(reference).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                expected[(s.name, tuple(sorted(s.labels.items())))] = s.value
    ours = {key: v for key, v in samples(m).items() if key[0].removeprefix("tokenmill:").startswith(names)}
    assert ours == expected and len(ours) == 2 * (len(ITL_BUCKETS) + 1 + 2)


def test_buffered_token_gaps_reach_the_histograms_on_flush_as_per_token_observes_would() -> None:
    """Multiprocess mode counts token gaps locally and adds them to the shared Histograms once per
    engine message (shared_histogram.BufferedHistograms): after `flush` the histograms export what
    per-token `observe` would have, before it nothing, and a second flush adds nothing."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tokenmill.metrics import ITL_BUCKETS
    from tokenmill.shared_histogram import BufferedHistograms

    def export(registry: CollectorRegistry) -> dict:
        return {
            (s.name.split(":", 1)[1], tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
            if not s.name.endswith("_created")
        }

    buffered, reference = CollectorRegistry(), CollectorRegistry()
    names = ("a_seconds", "b_seconds")
    targets = [Histogram("x:" + n, "doc", ["m"], buckets=ITL_BUCKETS, registry=buffered).labels("s") for n in names]
    plain = [Histogram("x:" + n, "doc", ["m"], buckets=ITL_BUCKETS, registry=reference).labels("s") for n in names]
    gaps = BufferedHistograms(targets)
    empty = export(buffered)
    for gap in (0.0, 0.001, 0.0011, 0.0025, 0.03, 0.03, 0.0300001, 5.0, 79.9, 80.0, 1e9):
        gaps.observe(gap)
        for h in plain:
            h.observe(gap)
    assert export(buffered) == empty  # nothing until flushed
    gaps.flush()
    assert export(buffered) == export(reference) != empty
    gaps.flush()
    assert export(buffered) == export(reference)
