"""The quality gate on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF), end to end through the
CLI: against itself it passes with nothing lost; FP8 of it (`--quantization fp8`) passes the
default thresholds; a copy whose one tensor has wrong scales fails, naming the metrics; and
`serve --quality-gate` refuses that copy before serving.

A short slice of the text set keeps each gate run to a few seconds."""

from __future__ import annotations

import json

import pytest

from tests.quality.broken_checkpoints import write_wrong_scale_gguf
from tokenmill.cli import main

ENGINE = ["--device", "cpu", "--max-model-len", "128", "--kv-cache-memory", "16MiB"]
SLICE = ["--window", "64", "--max-windows", "3", "--greedy-prompts", "3", "--greedy-tokens", "8"]


@pytest.fixture(scope="module")
def wrong_scale_gguf(default_model_path, tmp_path_factory):
    """The default model with the Q4_1 scales of one MLP down projection 1.5x too large."""
    target = tmp_path_factory.mktemp("broken") / "wrong-scales.gguf"
    return write_wrong_scale_gguf(default_model_path, target, "blk.5.ffn_down.weight", 1.5)


def test_the_default_model_against_itself_loses_nothing(default_model_path, capsys):
    base = ["--base", str(default_model_path)]
    code = main(["--log-level", "WARNING", "quality-gate", *base, *ENGINE, *SLICE, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["failed_metrics"] == []
    metrics = report["metrics"]
    assert metrics["mean_kl"] == 0.0 and metrics["max_kl"] == 0.0
    assert metrics["top1_agreement"] == 1.0 and metrics["greedy_agreement"] == 1.0
    assert metrics["perplexity_ratio"] == 1.0 and metrics["greedy_prefix_lengths"] == [8, 8, 8]
    assert 1 < metrics["base_perplexity"] < 100  # a language model reading English, not noise
    assert metrics["num_windows"] == 3 and report["candidate"] == "SmolLM2-135M-Instruct (device=cpu)"


def test_fp8_of_the_default_model_passes_the_default_thresholds(capsys):
    # A longer slice than the others: FP8's greedy agreement varies from prompt to prompt (0 to 8
    # of 8 tokens), and 8 prompts keep its mean well clear of the threshold.
    fp8_slice = ["--window", "128", "--max-windows", "4", "--greedy-prompts", "8", "--greedy-tokens", "8"]
    engine = ["--device", "cpu", "--max-model-len", "160", "--kv-cache-memory", "32MiB"]
    fp8 = ["--quantization", "fp8"]
    code = main(["--log-level", "WARNING", "quality-gate", *fp8, *engine, *fp8_slice, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"]
    assert report["candidate"] == "SmolLM2-135M-Instruct (quantization=fp8, device=cpu)"
    assert report["base"] == "SmolLM2-135M-Instruct (device=cpu)"
    metrics = report["metrics"]
    assert 0 < metrics["mean_kl"] < 0.05 and 0.9 < metrics["top1_agreement"] < 1  # changed, a little


def test_a_copy_with_wrong_scales_fails_naming_the_metrics(default_model_path, wrong_scale_gguf, capsys):
    code = main(
        ["--log-level", "WARNING", "quality-gate", str(wrong_scale_gguf), "--base", str(default_model_path),
         *ENGINE, *SLICE]
    )  # fmt: skip
    table = capsys.readouterr().out
    assert code == 1
    kl_row = next(line for line in table.splitlines() if line.startswith("mean KL"))
    assert kl_row.endswith("FAIL")
    assert table.splitlines()[-1].startswith("FAILED:")
    assert "(mean_kl)" in table and "(top1_agreement)" in table


def test_serve_quality_gate_refuses_a_failing_model_before_serving(
    default_model_path, wrong_scale_gguf, capsys, monkeypatch
):
    from tokenmill.server import launch

    def must_not_serve(args):
        raise AssertionError("serve started a model that failed the quality gate")

    monkeypatch.setattr(launch, "run_server", must_not_serve)
    gate = ["--quality-gate", "--quality-gate-base", str(default_model_path), "--quality-gate-window", "64",
            "--quality-gate-max-windows", "2", "--quality-gate-greedy-prompts", "2",
            "--quality-gate-greedy-tokens", "4"]  # fmt: skip
    code = main(["--log-level", "WARNING", "serve", str(wrong_scale_gguf), *ENGINE, *gate])
    err = capsys.readouterr().err
    assert code == 1
    assert "tokenmill serve: refusing to start: the model failed the quality gate (" in err
    assert "(mean_kl)" in err and "mean KL" in err and "FAILED:" in err  # the table is in the error


def test_serve_quality_gate_checks_serve_flags_before_measuring(default_model_path, capsys, monkeypatch):
    from tokenmill.quality import serve_gate

    def must_not_run(*args, **kwargs):
        raise AssertionError("the gate ran although a serve flag was wrong")

    monkeypatch.setattr(serve_gate, "run_gate_in_child", must_not_run)
    code = main(["serve", "--quality-gate", "--quality-gate-base", str(default_model_path), *ENGINE,
                 "--tool-call-parser", "no-such-parser"])  # fmt: skip
    assert code == 2 and "--tool-call-parser 'no-such-parser' is unknown" in capsys.readouterr().err
