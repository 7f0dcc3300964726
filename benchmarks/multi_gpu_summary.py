"""The table of benchmarks/multi_gpu.sh's results (issue 22), as BENCHMARKS.md shows it.

    python benchmarks/multi_gpu_summary.py OUT_DIR

Reads OUT_DIR's multi-gpu-*.json (bench latency / throughput / serve) and tp-agreement-*.json and
prints markdown: agreement per checkpoint; per model and size, single-stream tok/s with its
fraction of the aggregate-bandwidth roofline, offline output tok/s and per GPU; DP serving at
saturation against DP=1; the collectives' share of a decode step (profile_tp_decode.py); NCCL
against the one-shot all-reduce (all-reduce-microbench-*.json and the `-nccl` single streams).
Missing runs are left out (the script names what it skipped).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PATTERN = re.compile(
    r"multi-gpu-(?P<part>single|offline|dp|profile)-(?P<model>.+)-(?P<kind>tp|dp)(?P<n>\d+)(-b(?P<batch>\d+))?"
    r"(-(?P<variant>nccl|oneshot-lazy|oneshot))?-"
)


def load(out: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(engine runs, agreement runs, all-reduce microbenchmarks)"""
    runs, agreements, microbenches = [], [], []
    for path in sorted(out.glob("*.json")):
        record = json.loads(path.read_text())
        if path.name.startswith("tp-agreement-"):
            agreements.append({"name": path.stem.removeprefix("tp-agreement-"), **record})
        elif path.name.startswith("all-reduce-microbench-"):
            microbenches.append(record)
        elif match := PATTERN.match(path.name):
            runs.append({**match.groupdict(), "n": int(match["n"]), "record": record})
    return runs, agreements, microbenches


def agreement_lines(agreements: list[dict]) -> list[str]:
    lines = [
        "| checkpoint | sizes | agree | first divergence per prompt (vs the first size) |",
        "|---|---|---|---|",
    ]
    for a in agreements:
        metrics, config = a["metrics"], a["config"]
        cells = []
        for key, rows in metrics.items():
            if key == "agree":
                continue
            marks = [
                "="
                if r["first_divergence"] is None
                else f"{r['first_divergence']}{' (tie)' if r['tie'] else ' (NOT tie)'}"
                for r in rows
            ]
            cells.append(f"{key}: {', '.join(marks)}")
        sizes = ",".join(str(s) for s in config["sizes"])
        lines.append(
            f"| {a['name']} | {sizes} | {'yes' if metrics['agree'] else 'NO'} | {'; '.join(cells)} |"
        )
    return lines


def fmt(metrics: dict | None, key: str, spec: str, scale: float = 1.0) -> str:
    return spec.format(metrics[key] * scale) if metrics is not None else "-"


def scaling_lines(runs: list[dict]) -> list[str]:
    lines = [
        "| model | TP | single stream tok/s | roofline fraction (N x BW) | aggregate BW TB/s | offline out tok/s | per GPU |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = [r for r in runs if r["variant"] is None]  # the engine's defaults; A/B runs: all_reduce_lines
    keys = sorted({(r["model"], r["n"]) for r in runs if r["part"] in ("single", "offline")})
    for model, n in keys:
        single = next(
            (r["record"]["metrics"] for r in runs if (r["part"], r["model"], r["n"]) == ("single", model, n)),
            None,
        )
        offline = next(
            (
                r["record"]["metrics"]
                for r in runs
                if (r["part"], r["model"], r["n"]) == ("offline", model, n)
            ),
            None,
        )
        cells = [
            fmt(single, "decode_tokens_per_s", "{:.1f}"),
            fmt(single, "roofline_fraction", "{:.3f}"),
            fmt(single, "copy_bandwidth_bytes_per_s", "{:.2f}", 1e-12),
            fmt(offline, "output_tokens_per_s", "{:.0f}"),
            fmt(offline, "output_tokens_per_s_per_device", "{:.0f}"),
        ]
        lines.append(f"| {model} | {n} | {' | '.join(cells)} |")
    return lines


def dp_lines(runs: list[dict]) -> list[str]:
    dp = sorted((r for r in runs if r["part"] == "dp"), key=lambda r: r["n"])
    lines = [
        "| model | DP | output tok/s | vs DP=1 | median TTFT ms | p99 TTFT ms |",
        "|---|---|---|---|---|---|",
    ]
    base = next((r["record"]["metrics"]["output_throughput"] for r in dp if r["n"] == 1), None)
    for r in dp:
        m = r["record"]["metrics"]
        ratio = f"{m['output_throughput'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['model']} | {r['n']} | {m['output_throughput']:.0f} | {ratio} "
            f"| {m['median_ttft_ms']:.0f} | {m['p99_ttft_ms']:.0f} |"
        )
    return lines


def profile_lines(runs: list[dict]) -> list[str]:
    lines = [
        "| model | TP | batch | step ms | eager kernels ms | all-reduce ms | all-reduce share |",
        "|---|---|---|---|---|---|---|",
    ]
    profiles = sorted(
        (r for r in runs if r["part"] == "profile"), key=lambda r: (r["model"], r["n"], int(r["batch"] or 0))
    )
    for r in profiles:
        m = r["record"]["metrics"]
        lines.append(
            f"| {r['model']} | {r['n']} | {r['batch']} | {m['step_ms']:.2f} | {m['kernel_ms_per_step']:.2f} "
            f"| {m['collective_ms_per_step']:.2f} | {100 * m['collective_share']:.1f} % |"
        )
    return lines


def all_reduce_lines(runs: list[dict], microbenches: list[dict]) -> list[str]:
    """Per call (microbenchmark) and per decode step (single streams with and without it)."""
    lines = ["| what | TP | NCCL | one-shot (default) |", "|---|---|---|---|"]
    for record in microbenches:
        n = record["config"]["tp"]
        for row in record["metrics"]["rows"]:
            exact = "" if row["nccl_graph_exact"] and row["one_shot_graph_exact"] else " (NOT exact)"
            lines.append(
                f"| {row['kib']} KiB all-reduce, us{exact} | {n} | {row['nccl_us']:.1f} | {row['one_shot_us']:.1f} |"
            )
    for nccl in (r for r in runs if r["part"] == "single" and r["variant"] == "nccl"):
        default = next(
            (
                r
                for r in runs
                if (r["part"], r["model"], r["n"], r["variant"]) == ("single", nccl["model"], nccl["n"], None)
            ),
            None,
        )
        tok_s = nccl["record"]["metrics"]["decode_tokens_per_s"]
        other = fmt(default["record"]["metrics"] if default else None, "decode_tokens_per_s", "{:.1f}")
        lines.append(f"| {nccl['model']} single stream tok/s | {nccl['n']} | {tok_s:.1f} | {other} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="the folder benchmarks/multi_gpu.sh wrote its results to")
    out = parser.parse_args().out_dir
    if not out.is_dir():
        parser.error(f"{out} is not a folder; give the OUT folder of a benchmarks/multi_gpu.sh run")
    runs, agreements, microbenches = load(out)
    devices = sorted({r["record"]["device"] for r in runs} | {a["device"] for a in agreements})
    commits = sorted({r["record"]["commit"] for r in runs} | {a["commit"] for a in agreements})
    print(
        f"multi-GPU results in {out}: device {', '.join(devices) or '-'}; commit {', '.join(commits) or '-'}\n"
    )
    for title, lines in (
        ("Greedy agreement", agreement_lines(agreements) if agreements else []),
        ("Tensor-parallel scaling", scaling_lines(runs)),
        ("Data parallelism at saturation", dp_lines(runs)),
        ("All-reduce share of a decode step", profile_lines(runs)),
        ("NCCL against the one-shot all-reduce", all_reduce_lines(runs, microbenches)),
    ):
        if len(lines) > 2:
            print(f"### {title}\n")
            print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
