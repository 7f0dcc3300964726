"""Speculative decoding in `bench` results: the counters' gain over the measured run, from a
server's /metrics (`bench serve`) or an engine's stats (`bench latency` / `throughput`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.unit.test_bench_serve import FakeOpenAIServer
from tokenmill.bench import serve
from tokenmill.bench.prometheus_text import parse_samples
from tokenmill.bench.spec_decode import (
    format_spec_decode,
    spec_decode_summary,
    spec_decode_totals,
    totals_from_samples,
)
from tokenmill.metrics import ServerMetrics

PER_POS = "spec_decode_num_accepted_tokens_per_pos"


class SpeculatingServer(FakeOpenAIServer):
    """The fake server with a /metrics rendered by a real `ServerMetrics`. When `speculating`, each
    streamed token counts as one verifying step of 4 drafts, the first 2 accepted, in the totals
    the engine would report; the totals start from a non-zero past."""

    def __init__(self, speculating: bool) -> None:
        self.speculating = speculating
        self.metrics = ServerMetrics("fake-model")
        self.totals = {
            "spec_decode_num_drafts": 100.0,
            "spec_decode_num_draft_tokens": 400.0,
            "spec_decode_num_accepted_tokens": 100.0,
            **{f"{PER_POS}.{i}": 25.0 for i in range(4)},
        }
        super().__init__(num_tokens=6)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        # Counted before the stream starts, as the engine's stats arrive with the step's tokens: a
        # scrape right after the last response then sees every step.
        body = await request.json()
        max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
        steps = min(max_tokens, self.num_tokens)
        self.totals["spec_decode_num_drafts"] += steps
        self.totals["spec_decode_num_draft_tokens"] += 4 * steps
        self.totals["spec_decode_num_accepted_tokens"] += 2 * steps
        self.totals[f"{PER_POS}.0"] += steps
        self.totals[f"{PER_POS}.1"] += steps
        stats = dict(self.totals) if self.speculating else {}
        self.metrics.update_engine_stats({"num_running": 0.0, **stats})
        return await super()._generate(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_get("/metrics", self._metrics)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[SpeculatingServer]:
    fake = SpeculatingServer(speculating=request.param)
    fake.start()
    # Counters the server had before the benchmark: the result must leave them out.
    fake.metrics.update_engine_stats(fake.totals if fake.speculating else {})
    yield fake
    fake.stop()


def run_sweep(server: SpeculatingServer, tmp_path: Path) -> list[dict]:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", server.base_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "8",
        "--random-input-len", "20", "--random-output-len", "5", "--max-concurrency", "1,4",
        "--num-warmups", "2", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "spec",
    ])  # fmt: skip
    assert serve.main(args) == 0
    return [json.loads(p.read_text())["metrics"] for p in sorted(tmp_path.glob("spec-c*.json"))]


@pytest.mark.parametrize("server", [True], indirect=True)
def test_serve_reports_what_the_counters_gained_in_each_run(server: SpeculatingServer, tmp_path: Path) -> None:
    runs = run_sweep(server, tmp_path)
    assert len(runs) == 2
    for metrics in runs:
        # 8 requests of 5 tokens each: 40 steps of 4 drafts, 2 accepted (warm-ups and the past excluded).
        assert metrics["total_output_tokens"] == 40
        assert metrics["spec_decode"] == {
            "drafts": 40.0,
            "draft_tokens": 160.0,
            "accepted_tokens": 80.0,
            "acceptance_rate": 0.5,
            "mean_acceptance_length": 3.0,
            "accepted_per_position": [40.0, 40.0, 0.0, 0.0],
            "acceptance_rate_per_position": [1.0, 1.0, 0.0, 0.0],
        }


@pytest.mark.parametrize("server", [False], indirect=True)
def test_serve_without_speculation_reports_none(server: SpeculatingServer, tmp_path: Path) -> None:
    for metrics in run_sweep(server, tmp_path):
        assert metrics["completed"] == 8
        assert "spec_decode" not in metrics


def test_totals_from_metrics_text_of_any_prefix_summed_over_label_sets() -> None:
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total drafts",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 21.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0',
        'vllm:spec_decode_unknown_thing_total{model_name="m"} 3.0',
        'vllm:prompt_tokens_total{model_name="m"} 999.0',
    ])  # fmt: skip
    assert totals_from_samples(parse_samples(text)) == {
        "spec_decode_num_drafts": 15.0,
        "spec_decode_num_draft_tokens": 60.0,
        "spec_decode_num_accepted_tokens": 21.0,
        f"{PER_POS}.0": 13.0,
        f"{PER_POS}.1": 8.0,
    }
    assert totals_from_samples(None) == {}
    assert totals_from_samples(parse_samples('tokenmill:prompt_tokens_total{model_name="m"} 3.0')) == {}


def test_summary_of_engine_stats_and_its_edge_cases() -> None:
    stats = {
        "num_running": 1.0,
        "prefix_cache_hits": 7.0,
        "spec_decode_num_drafts": 4.0,
        "spec_decode_num_draft_tokens": 12.0,
        "spec_decode_num_accepted_tokens": 6.0,
        f"{PER_POS}.0": 3.0,
        f"{PER_POS}.1": 2.0,
        f"{PER_POS}.2": 1.0,
    }
    totals = spec_decode_totals(stats)
    assert set(totals) == set(stats) - {"num_running", "prefix_cache_hits"}
    summary = spec_decode_summary(None, totals)  # no reading before: the whole total counts
    assert summary is not None
    assert summary["acceptance_rate"] == 0.5 and summary["mean_acceptance_length"] == 2.5
    assert summary["acceptance_rate_per_position"] == [0.75, 0.5, 0.25]
    # Nothing verified during the run: counts of zero, no rates (not a division by zero).
    idle = spec_decode_summary(totals, totals)
    assert idle is not None and idle["drafts"] == 0.0
    assert idle["acceptance_rate"] is None and idle["mean_acceptance_length"] is None
    assert idle["acceptance_rate_per_position"] == [None, None, None]
    assert spec_decode_summary({}, spec_decode_totals({"num_running": 1.0})) is None
    report = format_spec_decode(summary)
    assert "Mean acceptance length:" in report and "2.50" in report and "0.75 0.50 0.25" in report
    assert "n/a" in format_spec_decode(idle)
