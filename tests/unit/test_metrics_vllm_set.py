"""vLLM's metric set under our prefix and under `--metrics-prefix vllm`; the per-request phase
histograms' arithmetic; cache_config_info and the LoRA load; and the Grafana dashboard in the repo
queries only metrics /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics import METRICS_PREFIXES, ServerMetrics

GRAFANA = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "tokenmill.json"
# vLLM's v1 metric names (docs/METRICS.md lists each with its meaning).
VLLM_NAMES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
    "prompt_tokens_total", "generation_tokens_total", "request_success_total",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "iteration_tokens_total_bucket",
    "request_params_n_bucket", "request_params_max_tokens_bucket", "request_max_num_generation_tokens_bucket",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "time_per_output_token_seconds_bucket",
    "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket", "request_inference_time_seconds_bucket",
    "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
    "cache_config_info", "lora_requests_info",
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
)  # fmt: skip


def _busy_metrics(prefix: str) -> ServerMetrics:
    """Metrics with every kind of observation made once, as a server under load has them."""
    m = ServerMetrics("smol", prefix=prefix)
    m.info.set_cache_config(block_size=16, num_gpu_blocks=100, cache_dtype="auto", enable_prefix_caching=True)
    m.info.set_lora_load(lambda: {"ada": 2, "idle": 0}, max_loras=4)
    m.on_request_params(n=2, max_tokens=64)
    m.on_request_max_generation_tokens(7)
    m.on_first_token(0.2)
    m.on_token_gap(0.01)
    m.on_request_finished("stop", prompt_tokens=10, generation_tokens=5, e2e=1.0, queue_time=0.1, ttft=0.2)
    m.on_request_rejected("queue_full")
    m.update_engine_stats({
        "num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.5, "prefix_cache_queries": 10,
        "prefix_cache_hits": 4, "num_preemptions_total": 1, "spec_decode_num_drafts": 3,
        "spec_decode_num_draft_tokens": 9, "spec_decode_num_accepted_tokens": 5,
        "spec_decode_num_accepted_tokens_per_pos.0": 3,
        "iteration_tokens_total_count": 2, "iteration_tokens_total_sum": 17,
        "iteration_tokens_total_bucket_le_1.0": 1, "iteration_tokens_total_bucket_le_16.0": 2,
    })  # fmt: skip
    return m


def _samples(m: ServerMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.mark.parametrize("prefix", sorted(METRICS_PREFIXES))
def test_every_vllm_metric_is_exported_under_the_prefix(prefix: str) -> None:
    names = set(_samples(_busy_metrics(METRICS_PREFIXES[prefix])))
    missing = [n for n in VLLM_NAMES if METRICS_PREFIXES[prefix] + n not in names]
    assert not missing, missing
    other = "vllm:" if prefix == "tokenmill" else "tokenmill:"
    assert not any(n.startswith(other) for n in names)


def test_request_phase_histograms_split_e2e() -> None:
    samples = _samples(_busy_metrics("tokenmill:"))

    def total(name: str) -> float:
        return samples[f"tokenmill:{name}_sum"][0].value

    assert total("request_queue_time_seconds") == pytest.approx(0.1)
    assert total("request_prefill_time_seconds") == pytest.approx(0.1)  # ttft 0.2 - queue 0.1
    assert total("request_decode_time_seconds") == pytest.approx(0.8)  # e2e 1.0 - ttft 0.2
    assert total("request_inference_time_seconds") == pytest.approx(0.9)  # e2e - queue
    assert total("request_time_per_output_token_seconds") == pytest.approx(0.8 / 4)
    assert total("request_prompt_tokens") == 10 and total("request_generation_tokens") == 5
    assert total("request_params_n") == 2 and total("request_params_max_tokens") == 64
    assert total("request_max_num_generation_tokens") == 7
    assert total("iteration_tokens_total") == 17


def test_info_metrics() -> None:
    samples = _samples(_busy_metrics("tokenmill:"))
    (info,) = samples["tokenmill:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "100"
    in_flight = {s.labels["lora_name"]: s.value for s in samples["tokenmill:lora_requests_in_flight"]}
    assert in_flight == {"ada": 2.0, "idle": 0.0}
    (lora_info,) = samples["tokenmill:lora_requests_info"]
    assert lora_info.labels["running_lora_adapters"] == "ada" and lora_info.labels["max_lora"] == "4"
    assert "tokenmill:lora_requests_info" not in _samples(ServerMetrics("plain"))  # LoRA off: no series


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"]["query"])
    queried = {name for expr in exprs for name in re.findall(r"tokenmill:[a-z0-9_]+", expr)}
    assert len(queried) >= 20
    exported = set(_samples(_busy_metrics("tokenmill:")))
    missing = sorted(queried - exported)
    assert not missing, f"the Grafana dashboard queries metrics /metrics does not export: {missing}"
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles))
