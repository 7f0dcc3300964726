"""Summary of benchmarks/spec_ngram_cpu.sh: speculation on against off at each concurrency.

Reads <name>-off-c<N>.json and <name>-on-c<N>.json (`bench serve` results) from --result-dir,
writes <name>-summary.json there and prints a table: output tok/s of each side, speedup (on / off),
mean TPOT of each side, and the "on" run's acceptance (rate, mean acceptance length, per position).
A concurrency with one side missing is listed without a speedup.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def load_runs(result_dir: Path, name: str) -> dict[int, dict[str, dict[str, Any]]]:
    """concurrency -> side ("off" / "on") -> that run's result record."""
    pattern = re.compile(rf"^{re.escape(name)}-(off|on)-c(\d+)\.json$")
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    for path in sorted(result_dir.glob(f"{name}-*-c*.json")):
        match = pattern.match(path.name)
        if match:
            runs.setdefault(int(match.group(2)), {})[match.group(1)] = json.loads(path.read_text())
    return runs


def summarize(runs: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for concurrency in sorted(runs):
        sides = runs[concurrency]
        row: dict[str, Any] = {"max_concurrency": concurrency}
        for side, record in sides.items():
            metrics = record["metrics"]
            row[f"{side}_output_throughput"] = metrics["output_throughput"]
            row[f"{side}_mean_tpot_ms"] = metrics["mean_tpot_ms"]
            row[f"{side}_completed"] = metrics["completed"]
            row[f"{side}_commit"] = record.get("commit")
        off, on = sides.get("off"), sides.get("on")
        row["speedup"] = (
            on["metrics"]["output_throughput"] / off["metrics"]["output_throughput"]
            if off and on and off["metrics"]["output_throughput"] > 0
            else None
        )
        # Greedy output is the same with speculation on and off: equal token counts say so here.
        row["same_output_tokens"] = (
            off["metrics"]["total_output_tokens"] == on["metrics"]["total_output_tokens"] if off and on else None
        )
        row["spec_decode"] = on["metrics"].get("spec_decode") if on else None
        rows.append(row)
    return {"runs": rows}


def format_table(summary: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"{'conc':>4} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>7} {'off TPOT':>8} {'on TPOT':>8} "
        f"{'accept':>6} {'mean len':>8}  per position"
    ]
    for row in summary["runs"]:
        spec = row["spec_decode"] or {}
        per_position = " ".join(num(r, ".2f") for r in spec.get("acceptance_rate_per_position", []))
        lines.append(
            f"{row['max_concurrency']:>4} {num(row.get('off_output_throughput'), '.1f'):>9} "
            f"{num(row.get('on_output_throughput'), '.1f'):>9} {num(row['speedup'], '.2f'):>7} "
            f"{num(row.get('off_mean_tpot_ms'), '.1f'):>8} {num(row.get('on_mean_tpot_ms'), '.1f'):>8} "
            f"{num(spec.get('acceptance_rate'), '.3f'):>6} {num(spec.get('mean_acceptance_length'), '.2f'):>8}  "
            f"{per_position or '-'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", default="benchmarks/results", help="where the bench serve results are")
    parser.add_argument("--name", required=True, help="the results' common name, e.g. spec-ngram-cpu-abc1234")
    args = parser.parse_args()
    result_dir = Path(args.result_dir)
    runs = load_runs(result_dir, args.name)
    if not runs:
        print(f"no {args.name}-(off|on)-c<N>.json results in {result_dir}", file=sys.stderr)
        return 1
    summary = summarize(runs)
    path = result_dir / f"{args.name}-summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
