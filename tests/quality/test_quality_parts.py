"""The quality gate's parts that need no model: the text set, the verdict, the report and its
table / JSON, which engines are compared, and the flags of `quality-gate` and `serve`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from tokenmill.args import EngineArgs
from tokenmill.cli import build_parser
from tokenmill.quality.cli import engine_args_of, gate_settings
from tokenmill.quality.gate import GatePlan, GateReport, plan_gate
from tokenmill.quality.metrics import GateMetrics, greedy_agreement
from tokenmill.quality.table import format_json, format_table
from tokenmill.quality.text_set import (
    MIN_WINDOW_TEXT_TOKENS,
    TEXT_FILES,
    TextSetOptions,
    build_text_set,
    read_texts,
    special_prefix,
)
from tokenmill.quality.verdict import Thresholds, judge


class CharTokenizer:
    """One token per character (its code point), optionally with a BOS (id 1) in front, as
    Llama-style tokenizers add."""

    def __init__(self, bos: bool) -> None:
        self.bos = bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        return [1, *ids] if add_special_tokens and self.bos else ids


def test_the_texts_ship_with_the_package_and_are_varied():
    texts = read_texts()
    assert len(texts) == len(TEXT_FILES) == 3
    assert all(len(t) > 1000 for t in texts)
    prose, code, lists = texts
    assert "lighthouse" in prose and "def binary_search" in code and "1. " in lists
    assert "quality/texts/*.txt" in (Path(__file__).parents[2] / "pyproject.toml").read_text()


@pytest.mark.parametrize("bos", [False, True])
def test_windows_cover_the_texts_in_order_with_the_special_prefix(bos):
    tokenizer = CharTokenizer(bos)
    prefix = [1] if bos else []
    assert special_prefix(tokenizer) == prefix
    options = TextSetOptions(window=100, greedy_prompts=4, greedy_prompt_tokens=10)
    text_set = build_text_set(tokenizer, options)
    assert all(len(w) <= 100 and list(w[: len(prefix)]) == prefix for w in text_set.windows)
    # Windows take turns over the texts: the first three open prose, code and lists.
    texts = read_texts()
    for window, text in zip(text_set.windows[:3], texts, strict=True):
        assert "".join(chr(t) for t in window[len(prefix) :]) == text[: 100 - len(prefix)]
    # Every character of every text is in exactly one window, but a last piece too short to score.
    per_window = 100 - len(prefix)
    short = [len(t) % per_window for t in texts]
    kept = sum(len(t) - (r if r < MIN_WINDOW_TEXT_TOKENS else 0) for t, r in zip(texts, short, strict=True))
    assert sum(len(w) - len(prefix) for w in text_set.windows) == kept
    assert text_set.num_scored_tokens == sum(len(w) - 1 for w in text_set.windows)
    assert len(text_set.greedy_prompts) == 4
    assert all(len(p) == len(prefix) + 10 for p in text_set.greedy_prompts)
    assert len(set(text_set.greedy_prompts)) == 4
    assert text_set.longest_sequence == 100


def test_max_windows_and_greedy_options():
    tokenizer = CharTokenizer(bos=False)
    full = build_text_set(tokenizer, TextSetOptions(window=64))
    cut = build_text_set(tokenizer, TextSetOptions(window=64, max_windows=2, greedy_prompts=0))
    assert cut.windows == full.windows[:2] and cut.greedy_prompts == ()
    # The prompts come from the whole set, whatever max_windows keeps.
    with_prompts = build_text_set(tokenizer, TextSetOptions(window=64, max_windows=2))
    assert with_prompts.greedy_prompts == full.greedy_prompts


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (TextSetOptions(window=1), "window must be at least 2"),
        (TextSetOptions(max_windows=0), "max_windows must be at least 1"),
        (TextSetOptions(greedy_prompts=-1), "greedy_prompts must be 0"),
        (TextSetOptions(greedy_tokens=0), "greedy_tokens must be at least 1"),
    ],
)
def test_bad_text_set_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        build_text_set(CharTokenizer(bos=False), options)


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    agreement, lengths = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert lengths == [2, 4]  # the 4 after the divergence does not count
    assert agreement == pytest.approx((2 / 4 + 4 / 4) / 2)
    assert greedy_agreement([], []) == (None, [])


def _metrics(**changes) -> GateMetrics:
    good = GateMetrics(
        base_perplexity=10.0, candidate_perplexity=10.2, mean_kl=0.02, max_kl=0.5, top1_agreement=0.95,
        greedy_agreement=0.8, greedy_prefix_lengths=(16, 10), num_windows=3, num_scored_tokens=300,
        greedy_tokens=16,
    )  # fmt: skip
    return dataclasses.replace(good, **changes)


def test_verdict_passes_within_every_threshold_and_names_each_failure():
    thresholds = Thresholds()
    assert judge(_metrics(), thresholds).passed
    at_limits = _metrics(candidate_perplexity=11.0, mean_kl=0.1, top1_agreement=0.85, greedy_agreement=0.25)
    assert judge(at_limits, thresholds).passed  # the limits themselves pass
    verdict = judge(_metrics(mean_kl=0.3, top1_agreement=0.7), thresholds)
    assert not verdict.passed
    assert [c.metric for c in verdict.failures] == ["mean_kl", "top1_agreement"]
    assert "mean KL 0.3 > 0.1 (mean_kl)" in verdict.describe_failures()
    assert verdict.to_dict()["failed_metrics"] == ["mean_kl", "top1_agreement"]


def test_nan_fails_and_an_unmeasured_greedy_metric_does_not():
    thresholds = Thresholds()
    verdict = judge(_metrics(mean_kl=math.nan, candidate_perplexity=math.nan), thresholds)
    assert {c.metric for c in verdict.failures} == {"mean_kl", "perplexity_ratio"}
    no_greedy = judge(_metrics(greedy_agreement=None, greedy_prefix_lengths=()), thresholds)
    assert no_greedy.passed


@pytest.mark.parametrize(
    "thresholds",
    [Thresholds(max_mean_kl=-1.0), Thresholds(min_top1_agreement=1.5), Thresholds(max_mean_kl=math.nan)],
)
def test_bad_thresholds_are_refused(thresholds):
    with pytest.raises(ValueError, match="threshold"):
        thresholds.check()


def _report(metrics: GateMetrics) -> GateReport:
    return GateReport(
        candidate="m (quantization=fp8)", base="m", options=TextSetOptions(), thresholds=Thresholds(),
        metrics=metrics, seconds=1.5,
    )  # fmt: skip


def test_table_and_json_of_a_failing_report():
    report = _report(_metrics(mean_kl=0.42, max_kl=math.inf))
    table = format_table(report)
    assert "candidate m (quantization=fp8)" in table
    kl_row = next(line for line in table.splitlines() if line.startswith("mean KL"))
    assert "0.420000" in kl_row and "<= 0.1" in kl_row and kl_row.endswith("FAIL")
    assert table.splitlines()[-1].startswith("FAILED: mean KL 0.42 > 0.1 (mean_kl)")
    data = json.loads(format_json(report))  # strict JSON: inf became null
    assert data["passed"] is False and data["failed_metrics"] == ["mean_kl"]
    assert data["metrics"]["max_kl"] is None and data["metrics"]["perplexity_ratio"] == pytest.approx(1.02)
    assert data["thresholds"]["max_mean_kl"] == 0.1 and data["text_set"]["window"] == 128


def test_report_round_trips_through_its_dict_nan_included():
    report = _report(_metrics(mean_kl=math.nan))
    again = GateReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert math.isnan(again.metrics.mean_kl) and not again.passed
    assert dataclasses.replace(again, metrics=report.metrics) == report


def test_plan_base_is_the_model_without_lossy_options(tiny_llama_dir):
    candidate = EngineArgs(
        model=str(tiny_llama_dir), kv_cache_dtype="bfloat16", device="cpu", max_model_len=64
    )
    plan = plan_gate(candidate)
    assert plan == GatePlan(candidate, dataclasses.replace(candidate, kv_cache_dtype="auto"))
    with pytest.raises(ValueError, match="nothing to compare.*--quantization METHOD.*--base BASE_MODEL"):
        plan_gate(dataclasses.replace(candidate, kv_cache_dtype="auto"))


def test_plan_with_a_base_model_keeps_the_candidates_device_and_sizes(tiny_llama_dir, tmp_path):
    candidate = EngineArgs(model="some/quantized-model", revision="v2", device="cpu", max_model_len=64)
    plan = plan_gate(candidate, str(tiny_llama_dir))
    assert plan.base == dataclasses.replace(candidate, model=str(tiny_llama_dir), revision=None)


def test_plan_resets_quantization_for_the_base(tiny_llama_dir):
    candidate = EngineArgs(
        model=str(tiny_llama_dir), quantization="fp8", kv_cache_dtype="float16", device="cpu"
    )
    unquantized = dataclasses.replace(candidate, quantization=None, kv_cache_dtype="auto")
    assert plan_gate(candidate).base == unquantized
    assert plan_gate(candidate, "other/model").base.quantization is None


def test_quality_gate_flags():
    args = build_parser().parse_args(
        ["quality-gate", "some/model", "--base", "some/base", "--max-mean-kl", "0.05", "--window", "64",
         "--greedy-prompts", "0", "--json"]
    )  # fmt: skip
    base, options, thresholds = gate_settings(args)
    assert base == "some/base" and args.json
    assert options == TextSetOptions(window=64, greedy_prompts=0)
    assert thresholds == Thresholds(max_mean_kl=0.05)
    assert engine_args_of(args).model == "some/model"
    twice = build_parser().parse_args(["quality-gate", "a/b", "--model", "c/d"])
    with pytest.raises(ValueError, match="given twice"):
        engine_args_of(twice)


def test_serve_takes_the_gate_flags_with_a_prefix():
    args = build_parser().parse_args(
        ["serve", "some/model", "--quality-gate", "--quality-gate-base", "b/c",
         "--quality-gate-min-top1-agreement", "0.9", "--quality-gate-max-windows", "4"]
    )  # fmt: skip
    assert args.quality_gate
    base, options, thresholds = gate_settings(args, "quality-gate-")
    assert base == "b/c" and options == TextSetOptions(max_windows=4)
    assert thresholds == Thresholds(min_top1_agreement=0.9)
    assert not build_parser().parse_args(["serve"]).quality_gate


def test_serve_starts_a_model_that_passes_and_refuses_one_that_fails(tiny_llama_dir, monkeypatch, capsys):
    """The decision of `serve --quality-gate`, with the child process's report given."""
    from tokenmill import cli
    from tokenmill.quality import serve_gate
    from tokenmill.server import launch

    served = []
    monkeypatch.setattr(launch, "run_server", lambda args: served.append(args.model_tag) or 0)
    argv = ["serve", str(tiny_llama_dir), "--device", "cpu", "--quantization", "fp8", "--quality-gate"]
    plans = []

    def child(metrics):
        def run(plan, options, thresholds, log_level="INFO"):
            plans.append(plan)
            return dataclasses.replace(_report(metrics), thresholds=thresholds, options=options)

        return run

    monkeypatch.setattr(serve_gate, "run_gate_in_child", child(_metrics()))
    assert cli.main(argv) == 0 and served == [str(tiny_llama_dir)]
    assert plans[0].candidate.quantization == "fp8" and plans[0].base.quantization is None
    assert capsys.readouterr().err.splitlines()[-1].startswith("PASSED")

    monkeypatch.setattr(serve_gate, "run_gate_in_child", child(_metrics(top1_agreement=0.5)))
    assert cli.main(argv) == 1 and served == [str(tiny_llama_dir)]  # not served again
    err = capsys.readouterr().err
    assert "refusing to start: the model failed the quality gate (top-1 agreement 0.5 < 0.85" in err
    assert "FAILED:" in err
    # Its thresholds are serve's --quality-gate-* flags.
    assert cli.main([*argv, "--quality-gate-min-top1-agreement", "0.4"]) == 0 and len(served) == 2
    # A model the gate cannot even find stops serve with the reason, not a traceback.
    assert cli.main(["serve", "no/such-model", "--device", "cpu", "--quantization", "fp8", "--quality-gate"]) == 2
    assert "tokenmill serve: error: model 'no/such-model'" in capsys.readouterr().err
