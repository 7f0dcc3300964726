"""Ratios of `tokenmill serve` to `llama-server` from benchmarks/llama_cpp_baseline.sh's result files.

Reads `llama-cpp-baseline-<tag>-<side>-r<round>-c<C>.json`, writes one
`llama-cpp-baseline-<tag>-summary.json` (per concurrency: each side's output tok/s, TTFT p50 and
ITL p99 per round, and the per-round ratios tokenmill / llama-server) and prints a Markdown table.

    PYTHONPATH=src python benchmarks/llama_cpp_baseline_summary.py --tag 1a2b3c4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from tokenmill.bench.results import write_result

SIDES = ("llama-server", "tokenmill")


def load_runs(result_dir: Path, tag: str) -> dict[int, dict[str, dict[int, dict]]]:
    """concurrency -> side -> round -> metrics."""
    pattern = re.compile(rf"llama-cpp-baseline-{re.escape(tag)}-(llama-server|tokenmill)-r(\d+)-c(\d+)\.json$")
    runs: dict[int, dict[str, dict[int, dict]]] = {}
    for path in sorted(result_dir.glob(f"llama-cpp-baseline-{tag}-*.json")):
        match = pattern.search(path.name)
        if match is None:
            continue
        side, run, concurrency = match.group(1), int(match.group(2)), int(match.group(3))
        runs.setdefault(concurrency, {}).setdefault(side, {})[run] = json.loads(path.read_text())["metrics"]
    return runs


def summarize(runs: dict[int, dict[str, dict[int, dict]]]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for concurrency in sorted(runs):
        sides = runs[concurrency]
        rounds = sorted(set(sides.get(SIDES[0], {})) & set(sides.get(SIDES[1], {})))
        entry: dict = {"rounds": rounds}
        for side in SIDES:
            entry[side] = {
                key: [sides[side][r][key] for r in rounds]
                for key in ("output_throughput", "median_ttft_ms", "p99_itl_ms", "median_tpot_ms")
            }
        entry["output_ratio"] = [
            sides["tokenmill"][r]["output_throughput"] / sides["llama-server"][r]["output_throughput"] for r in rounds
        ]
        summary[f"c{concurrency}"] = entry
    return summary


def markdown(summary: dict[str, dict]) -> str:
    lines = [
        "| concurrency | llama-server out tok/s | tokenmill out tok/s | ratio | tokenmill TTFT p50 ms | "
        "tokenmill ITL p99 ms | llama-server TTFT p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def fmt(values: list[float], digits: int = 1) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in values)

    for key, entry in summary.items():
        lines.append(
            f"| {key[1:]} | {fmt(entry['llama-server']['output_throughput'])} | "
            f"{fmt(entry['tokenmill']['output_throughput'])} | {fmt(entry['output_ratio'], 2)} | "
            f"{fmt(entry['tokenmill']['median_ttft_ms'], 0)} | {fmt(entry['tokenmill']['p99_itl_ms'], 0)} | "
            f"{fmt(entry['llama-server']['median_ttft_ms'], 0)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--tag", required=True, help="the TAG the baseline script ran with")
    args = parser.parse_args()
    summary = summarize(load_runs(Path(args.result_dir), args.tag))
    if not summary:
        raise SystemExit(f"no llama-cpp-baseline-{args.tag}-* result files in {args.result_dir}")
    config = {"tag": args.tag, "workload": "random 128/128, ignore_eos, same client, servers back to back"}
    path = write_result(
        "llama-cpp-baseline", config, {"by_concurrency": summary, "mean_ratio": {
            key: statistics.mean(entry["output_ratio"]) for key, entry in summary.items()
        }}, args.result_dir, f"llama-cpp-baseline-{args.tag}-summary",
    )
    print(markdown(summary))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
