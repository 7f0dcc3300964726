"""`bench latency` and `bench throughput` put the speculative decoding counters' gain over the
timed runs in their results (warm-ups left out), and nothing when the engine does not speculate.

The engine's totals are faked: each step that emits a request's token counts as one verifying
step of 2 drafts, 1 accepted (at position 0), so the expected gain is known from the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import build_parser
from tokenmill.engine.engine_core import EngineCore

PER_POS = "spec_decode_num_accepted_tokens_per_pos"


@pytest.fixture
def fake_spec_stats(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    totals = {
        "spec_decode_num_drafts": 0.0,
        "spec_decode_num_draft_tokens": 0.0,
        "spec_decode_num_accepted_tokens": 0.0,
        f"{PER_POS}.0": 0.0,
        f"{PER_POS}.1": 0.0,
    }
    step, get_stats = EngineCore.step, EngineCore.get_stats

    def counting_step(self: EngineCore) -> list:
        outputs = step(self)
        for out in outputs:
            n = len(out.new_token_ids)
            totals["spec_decode_num_drafts"] += n
            totals["spec_decode_num_draft_tokens"] += 2 * n
            totals["spec_decode_num_accepted_tokens"] += n
            totals[f"{PER_POS}.0"] += n
        return outputs

    monkeypatch.setattr(EngineCore, "step", counting_step)
    monkeypatch.setattr(EngineCore, "get_stats", lambda self: get_stats(self) | totals)
    return totals


def run_bench(command: str, model: Path, out: Path, *extra: str) -> dict:
    from tokenmill.bench import latency, throughput

    argv = ["bench", command, "--model", str(model), "--device", "cpu", "--max-model-len", "64"]
    argv += ["--result-dir", str(out), "--result-name", command, *extra]
    args = build_parser().parse_args(argv)
    (latency if command == "latency" else throughput).main(args)
    return json.loads((out / f"{command}.json").read_text())["metrics"]


EXPECTED_PER_TOKEN = {  # the summary of n tokens is n times these, rates aside
    "drafts": 1.0,
    "draft_tokens": 2.0,
    "accepted_tokens": 1.0,
    "accepted_per_position": [1.0, 0.0],
}


def check(summary: dict, tokens: int) -> None:
    for key, per_token in EXPECTED_PER_TOKEN.items():
        expected = [tokens * v for v in per_token] if isinstance(per_token, list) else tokens * per_token
        assert summary[key] == expected, key
    assert summary["acceptance_rate"] == 0.5
    assert summary["mean_acceptance_length"] == 2.0
    assert summary["acceptance_rate_per_position"] == [1.0, 0.0]


def test_latency_counts_the_timed_runs_only(tiny_llama_dir: Path, tmp_path: Path, fake_spec_stats: dict) -> None:
    metrics = run_bench(
        "latency", tiny_llama_dir, tmp_path, "--input-len", "8", "--output-len", "6", "--num-iters", "2"
    )
    check(metrics["spec_decode"], tokens=2 * 6)  # the 8-token warm-up is not in it
    assert fake_spec_stats["spec_decode_num_drafts"] == 8 + 2 * 6


def test_throughput_counts_the_timed_run_only(tiny_llama_dir: Path, tmp_path: Path, fake_spec_stats: dict) -> None:
    metrics = run_bench(
        "throughput", tiny_llama_dir, tmp_path, "--num-prompts", "3", "--input-len", "4", "--output-len", "5"
    )
    check(metrics["spec_decode"], tokens=3 * 5)
    assert fake_spec_stats["spec_decode_num_drafts"] == 3 * 8 + 3 * 5  # the warm-up: 3 prompts x 8


def test_no_speculation_no_spec_decode_key(tiny_llama_dir: Path, tmp_path: Path) -> None:
    metrics = run_bench(
        "latency", tiny_llama_dir, tmp_path, "--input-len", "8", "--output-len", "4", "--num-iters", "1"
    )
    assert metrics["decode_tokens_per_s"] > 0
    assert "spec_decode" not in metrics
