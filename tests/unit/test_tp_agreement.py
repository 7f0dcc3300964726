"""benchmarks/tp_agreement.py's comparison: a divergence is allowed only at a tie of the reference
(its top-2 logprob margin within the tie margin) and after the first 4 tokens; and the summary
script's table reads the files multi_gpu.sh writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import tokenmill

BENCHMARKS = Path(tokenmill.__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_divergence_allowed_only_at_a_reference_tie_after_four_tokens():
    agreement = _load("tp_agreement")
    lps = [-0.5, -1.0, -0.25, -2.0, -0.75, -1.5]
    ref = {"tokens": [1, 2, 3, 4, 5, 6], "top2_margins": [1.0, 1.0, 1.0, 1.0, 0.1, 1.0], "logprobs": lps}
    same = {"tokens": [1, 2, 3, 4, 5, 6], "logprobs": [lp + 0.125 for lp in lps]}
    assert agreement.compare(ref, same, 0.25) == {
        "agree": True, "first_divergence": None, "compared": 6, "max_logprob_gap": 0.125,
    }  # fmt: skip
    # The gap counts the tokens before the divergence only (the diverged one's is another token's).
    tie = agreement.compare(
        ref, {"tokens": [1, 2, 3, 4, 9, 9], "logprobs": [*lps[:3], -2.5, -9.0, -9.0]}, 0.25
    )
    assert (
        tie["agree"] and tie["tie"] and tie["first_divergence"] == 4 and tie["reference_top2_margin"] == 0.1
    )
    assert tie["compared"] == 4 and tie["max_logprob_gap"] == 0.5
    no_tie = agreement.compare(ref, {"tokens": [1, 2, 3, 4, 5, 9], "logprobs": lps}, 0.25)
    assert not no_tie["agree"] and not no_tie["tie"] and no_tie["first_divergence"] == 5
    early = {"tokens": [1, 2, 3], "top2_margins": [1.0, 0.0, 1.0], "logprobs": [-1.0, -1.0, -1.0]}
    assert not agreement.compare(early, {"tokens": [1, 7, 3], "logprobs": [-1.0] * 3}, 0.25)["agree"], (
        "a tie within the first 4 tokens"
    )


def test_summary_table(tmp_path, capsys):
    summary = _load("multi_gpu_summary")
    common = {"device": "NVIDIA H200 x2", "commit": "abc", "config": {}}
    files = {
        "multi-gpu-single-llama-3.1-8b-tp2-h200-abc.json": {
            "decode_tokens_per_s": 250.0, "roofline_fraction": 0.7, "copy_bandwidth_bytes_per_s": 8e12,
        },
        "multi-gpu-offline-llama-3.1-8b-tp2-h200-abc.json": {
            "output_tokens_per_s": 9000.0, "output_tokens_per_s_per_device": 4500.0,
        },
        "multi-gpu-dp-llama-3.1-8b-dp1-h200-abc.json": {
            "output_throughput": 5000.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 300.0,
        },
        "multi-gpu-dp-llama-3.1-8b-dp2-h200-abc.json": {
            "output_throughput": 9500.0, "median_ttft_ms": 80.0, "p99_ttft_ms": 200.0,
        },
        "multi-gpu-profile-llama-3.1-70b-tp2-b64-h200-abc.json": {
            "step_ms": 21.5, "kernel_ms_per_step": 20.0, "collective_ms_per_step": 2.5, "collective_share": 0.125,
        },
        # the NCCL-only A/B run of the same size: its own table, not the scaling row
        "multi-gpu-single-llama-3.1-8b-tp2-nccl-h200-abc.json": {
            "decode_tokens_per_s": 200.0, "roofline_fraction": 0.56, "copy_bandwidth_bytes_per_s": 8e12,
        },
    }  # fmt: skip
    for name, metrics in files.items():
        (tmp_path / name).write_text(json.dumps({**common, "metrics": metrics}))
    assert summary.main.__module__  # the script's entry point exists
    microbench = {**common, "config": {"tp": 2}, "metrics": {"rows": [
        {"kib": 16, "nccl_us": 18.0, "one_shot_us": 6.5, "nccl_graph_exact": True, "one_shot_graph_exact": False},
    ]}}  # fmt: skip
    (tmp_path / "all-reduce-microbench-tp2-h200-abc.json").write_text(json.dumps(microbench))
    runs, agreements, microbenches = summary.load(tmp_path)
    assert not agreements and len(runs) == 6 and len(microbenches) == 1
    scaling = summary.scaling_lines(runs)
    assert "| llama-3.1-8b | 2 | 250.0 | 0.700 | 8.00 | 9000 | 4500 |" in scaling
    assert not any("200.0" in line for line in scaling)
    all_reduce = summary.all_reduce_lines(runs, microbenches)
    assert "| 16 KiB all-reduce, us (NOT exact) | 2 | 18.0 | 6.5 |" in all_reduce
    assert "| llama-3.1-8b single stream tok/s | 2 | 200.0 | 250.0 |" in all_reduce
    assert "| llama-3.1-8b | 2 | 9500 | 1.90x | 80 | 200 |" in summary.dp_lines(runs)
    assert "| llama-3.1-70b | 2 | 64 | 21.50 | 20.00 | 2.50 | 12.5 % |" in summary.profile_lines(runs)
