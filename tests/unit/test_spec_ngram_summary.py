"""benchmarks/spec_ngram_summary.py: speedup and acceptance from `bench serve` result files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import tokenmill

SCRIPT = Path(tokenmill.__file__).parents[2] / "benchmarks" / "spec_ngram_summary.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_ngram_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, throughput: float, output_tokens: int, spec_decode: dict | None = None) -> None:
    metrics = {"output_throughput": throughput, "mean_tpot_ms": 1000 / throughput, "completed": 8,
               "total_output_tokens": output_tokens}  # fmt: skip
    if spec_decode is not None:
        metrics["spec_decode"] = spec_decode
    path.write_text(json.dumps({"commit": "abc", "metrics": metrics}))


def test_speedup_per_concurrency_and_a_missing_side(tmp_path: Path) -> None:
    summary_script = load_script()
    spec = {"acceptance_rate": 0.5, "mean_acceptance_length": 3.0, "acceptance_rate_per_position": [0.8, 0.6]}
    write(tmp_path / "x-off-c1.json", 20.0, 900)
    write(tmp_path / "x-on-c1.json", 30.0, 900, spec)
    write(tmp_path / "x-off-c8.json", 80.0, 1800)
    write(tmp_path / "other-on-c8.json", 1.0, 1)  # another run's name: not read
    summary = summary_script.summarize(summary_script.load_runs(tmp_path, "x"))
    c1, c8 = summary["runs"]
    assert (c1["max_concurrency"], c1["speedup"], c1["same_output_tokens"]) == (1, 1.5, True)
    assert c1["spec_decode"] == spec
    assert (c8["max_concurrency"], c8["speedup"], c8["spec_decode"]) == (8, None, None)
    table = summary_script.format_table(summary)
    assert "1.50" in table and "0.80 0.60" in table and "3.00" in table
