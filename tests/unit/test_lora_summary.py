"""benchmarks/lora_summary.py: multi-LoRA runs against LoRA off, from `bench throughput` result files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import tokenmill

SCRIPT = Path(tokenmill.__file__).parents[2] / "benchmarks" / "lora_summary.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lora_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root: Path, name: str, tok_s: float, lora: dict | None, timestamp: str = "2026-11-25T00:00:00+00:00") -> None:
    config = {"num_prompts": 512} | ({"lora": lora} if lora is not None else {})
    metrics = {"output_tokens_per_s": tok_s} | ({"lora": {"host_loads": 0, "slot_loads": 5}} if lora else {})
    record = {"benchmark": "throughput", "device": "H100", "commit": "abc", "timestamp": timestamp,
              "config": config, "metrics": metrics}  # fmt: skip
    (root / f"lora-llama-3.1-8b-{name}-h100-abc.json").write_text(json.dumps(record))


def lora(adapters: int, rank: int, base_only: bool = False, slots: int = 8) -> dict:
    return {"adapters": adapters, "rank": rank, "slots": slots, "base_only": base_only}


def test_ratios_against_off_and_the_targets(tmp_path: Path) -> None:
    summary = load_script()
    write(tmp_path, "off", 1000.0, None)
    write(tmp_path, "base-only", 980.0, lora(8, 16, base_only=True))
    write(tmp_path, "n8-r16", 700.0, lora(8, 16))
    write(tmp_path, "n32-r16", 500.0, lora(32, 16))
    write(tmp_path, "n2-r16", 900.0, lora(2, 16, slots=2))
    write(tmp_path, "n8-r16-old", 100.0, lora(8, 16), timestamp="2026-11-24T00:00:00+00:00")  # an older n8-r16
    (tmp_path / "lora-llama-3.1-8b-off-h200-abc.json").write_text("not read: another GPU")
    assert summary.main([str(tmp_path), "--gpu", "h100", "--commit", "abc"]) == 0
    rows = json.loads((tmp_path / "lora-summary-h100-abc.json").read_text())
    by_run = {r["run"]: r for r in rows}
    assert [r["run"] for r in rows] == ["off", "base-only", "n2-r16-s2", "n8-r16", "n32-r16"]
    assert by_run["off"]["x_off"] == 1.0 and by_run["off"]["meets_target"] is None
    assert by_run["base-only"]["x_off"] == 0.98 and by_run["base-only"]["meets_target"] is True
    assert by_run["base-only"]["adapters"] == 0
    assert by_run["n8-r16"]["x_off"] == 0.7 and by_run["n8-r16"]["meets_target"] is False  # the newer file
    assert by_run["n32-r16"]["x_off"] == 0.5 and by_run["n32-r16"]["slot_loads_timed"] == 5


def test_no_off_run_no_ratios_and_no_results_is_an_error(tmp_path: Path, capsys) -> None:
    summary = load_script()
    assert summary.main([str(tmp_path)]) == 1
    assert "no lora-*.json" in capsys.readouterr().err
    write(tmp_path, "n8-r16", 700.0, lora(8, 16))
    assert summary.main([str(tmp_path)]) == 0
    assert "no 'off' run" in capsys.readouterr().err
    rows = json.loads((tmp_path / "lora-summary.json").read_text())
    assert rows[0]["x_off"] is None and rows[0]["meets_target"] is None
