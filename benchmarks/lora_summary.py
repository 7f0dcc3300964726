"""Summary of benchmarks/lora_gpu.sh: each multi-LoRA run's throughput against LoRA off.

Reads the `bench throughput` results lora-*.json in DIR (those of --gpu / --commit when given),
names each run by its config's lora block (off: none; base-only; n<adapters>-r<rank>, with
-s<slots> unless 8 slots), prints a
table of output tok/s, the ratio to "off" and issue 18's targets (base-only >= 0.97x off; 8
adapters of rank 16 in 8 slots >= 0.8x off), and writes lora-summary[-<gpu>][-<commit>].json there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# run -> the least ratio to "off" that issue 18 asks for
TARGETS = {"base-only": 0.97, "n8-r16": 0.8}
SCRIPT_SLOTS = 8  # lora_gpu.sh's --max-loras; a run with other slots is labelled -s<slots>


def run_label(record: dict[str, Any]) -> str:
    lora = record["config"].get("lora")
    if lora is None:
        return "off"
    if lora["base_only"]:
        return "base-only"
    label = f"n{lora['adapters']}-r{lora['rank']}"
    if lora["slots"] != SCRIPT_SLOTS:
        label += f"-s{lora['slots']}"
    return label


def load_runs(result_dir: Path, gpu: str | None, commit: str | None) -> dict[str, dict[str, Any]]:
    """run label -> its result record (the latest, when a label has several)."""
    runs: dict[str, dict[str, Any]] = {}
    for path in sorted(result_dir.glob("lora-*.json")):
        if path.name.startswith("lora-summary") or (gpu and f"-{gpu}" not in path.stem):
            continue
        if commit and not path.stem.endswith(f"-{commit}"):
            continue
        record = json.loads(path.read_text())
        if record.get("benchmark") != "throughput":
            continue
        label = run_label(record)
        if label not in runs or record["timestamp"] > runs[label]["timestamp"]:
            runs[label] = record
    return runs


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run, "off" first, then the rest by (adapters, rank)."""
    off = runs.get("off")
    reference = off["metrics"]["output_tokens_per_s"] if off else None

    def order(label: str) -> tuple:
        lora = runs[label]["config"].get("lora") or {}
        return (label != "off", label != "base-only", lora.get("adapters", 0), lora.get("rank", 0), label)

    rows = []
    for label in sorted(runs, key=order):
        record = runs[label]
        lora = record["config"].get("lora") or {}
        tok_s = record["metrics"]["output_tokens_per_s"]
        ratio = tok_s / reference if reference else None
        target = TARGETS.get(label)
        rows.append({
            "run": label,
            "adapters": lora.get("adapters", 0) if not lora.get("base_only") else 0,
            "rank": lora.get("rank"),
            "slots": lora.get("slots"),
            "output_tokens_per_s": tok_s,
            "x_off": ratio,
            "target_x_off": target,
            "meets_target": None if target is None or ratio is None else ratio >= target,
            "slot_loads_timed": (record["metrics"].get("lora") or {}).get("slot_loads"),
            "device": record["device"],
            "commit": record["commit"],
        })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'run':<12}{'adapters':>9}{'rank':>6}{'slots':>6}{'output tok/s':>14}{'x off':>8}{'target':>8}"
             f"{'ok':>5}{'slot loads':>12}"]  # fmt: skip
    for r in rows:
        ok = {None: "-", True: "yes", False: "NO"}[r["meets_target"]]
        lines.append(
            f"{r['run']:<12}{r['adapters']:>9}{cell(r['rank'], 'd'):>6}{cell(r['slots'], 'd'):>6}"
            f"{r['output_tokens_per_s']:>14.1f}{cell(r['x_off'], '.3f'):>8}{cell(r['target_x_off'], '.2f'):>8}"
            f"{ok:>5}{cell(r['slot_loads_timed'], 'd'):>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="the OUT directory of benchmarks/lora_gpu.sh")
    parser.add_argument("--gpu", default=None, help="only result files with this GPU suffix (h100, h200)")
    parser.add_argument("--commit", default=None, help="only result files of this commit (their name's end)")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    runs = load_runs(root, args.gpu, args.commit)
    if not runs:
        print(f"no lora-*.json throughput results in {root}", file=sys.stderr)
        return 1
    rows = summarize(runs)
    print(format_table(rows))
    if "off" not in runs:
        print("no 'off' run (LoRA disabled): no ratios", file=sys.stderr)
    name = "-".join(["lora-summary", *(x for x in (args.gpu, args.commit) if x)]) + ".json"
    (root / name).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {root / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
