"""The compact summary of benchmarks/kv_tier_gpu.sh (issue 21): host-tier TTFT re-hit vs recompute
per context length and mode, and colocated vs disaggregated serving (ITL, TTFT, throughput).

  python benchmarks/kv_tier_summary.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def tier_lines(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return ["host tier: no result (kv-tier-offload.json missing: see kv-tier-offload.log)"]
    metrics = record["metrics"]
    lines = [
        f"host tier on {record['device']} (commit {record['commit']}), device pool {metrics['device_pool_tokens']} "
        "tokens: TTFT median of host re-hits vs recomputing the same length",
        f"  {'mode':<9} {'context':>8} {'re-hits':>8} {'re-hit s':>9} {'recomp s':>9} {'ratio':>7}",
    ]
    for mode, result in metrics["passes"].items():
        for context, row in result["per_context"].items():
            lines.append(
                f"  {mode:<9} {context:>8} {row['host_rehits']:>8} {_fmt(row['ttft_host_rehit_median_s']):>9} "
                f"{_fmt(row['ttft_recompute_median_s']):>9} {_fmt(row['recompute_over_host_rehit'], '.2f'):>7}"
            )
        counters = result["connector_counters"]
        lines.append(
            f"  {mode:<9} {'all':>8} {result['host_rehits']:>8} {_fmt(result['ttft_host_rehit_median_s']):>9} "
            f"{_fmt(result['ttft_host_rehit_recompute_median_s']):>9} "
            f"{_fmt(result['recompute_over_host_rehit'], '.2f'):>7}   (layers waited in forward "
            f"{counters['layers_waited_in_forward']}, at once {counters['layers_waited_at_once']}; "
            f"blocks loaded {result['second_turn_counters']['kv_offload_blocks_loaded']})"
        )
        rows = result.get("rows", [])
        if rows and "rehit_load_calls" in rows[0]:  # results since the copy counters
            load, loaded, save, saved = (
                sum(r[f"rehit_{key}"] for r in rows)
                for key in ("load_calls", "block_layers_loaded", "save_calls", "block_layers_saved")
            )
            lines.append(
                f"  {mode:<9} second turns' copy calls: loads {load} for {loaded} block-layers, saves {save} for {saved}"
            )
    return [*lines, *copy_lines(metrics, "the engine's pools")]


def copy_lines(metrics: dict[str, Any], pools: str) -> list[str]:
    """The raw copy timings (kv_offload.py's copy_bandwidth), if the record has them."""
    bandwidth = metrics.get("copy_bandwidth")
    if not bandwidth:
        return []
    lines = [
        f"raw copies of {bandwidth['tokens']} tokens ({bandwidth['blocks']} blocks) on {metrics['device']}, "
        f"{pools}, one step each:"
    ]
    for name, row in bandwidth.items():
        if isinstance(row, dict):
            lines.append(
                f"  {name:<22} {row['seconds'] * 1e3:7.1f} ms {row['gb_per_s']:6.1f} GB/s "
                f"{row['copy_calls']:>6} copy calls, queued in {row['queue_seconds'] * 1e3:.1f} ms"
            )
    return lines


SERVE_COLUMNS = (
    ("completed", "done", "d"),
    ("output_throughput", "out tok/s", ".1f"),
    ("mean_itl_ms", "ITL mean", ".1f"),
    ("p99_itl_ms", "ITL p99", ".1f"),
    ("median_ttft_ms", "TTFT p50", ".0f"),
    ("p99_ttft_ms", "TTFT p99", ".0f"),
)


def disagg_lines(out: Path) -> list[str]:
    runs = {name: _load(out / f"disagg-itl-{name}.json") for name in ("colocated", "disaggregated")}
    if not any(runs.values()):
        return [
            "disaggregation: no result (disagg-itl-*.json missing: see disagg-itl.log and the server logs)"
        ]
    device = next(r["device"] for r in runs.values() if r)
    lines = [
        f"disaggregation on {device} (a producer and a consumer sharing it vs one colocated engine; ms)",
        "  " + f"{'':<14}" + "".join(f"{title:>11}" for _, title, _ in SERVE_COLUMNS),
    ]
    for name, record in runs.items():
        if record is None:
            lines.append(f"  {name:<14} no result")
            continue
        metrics = record["metrics"]
        cells = "".join(f"{_fmt(metrics.get(key), spec):>11}" for key, _, spec in SERVE_COLUMNS)
        lines.append(f"  {name:<14}{cells}")
    both = [r["metrics"] for r in runs.values() if r]
    if len(both) == 2 and both[1].get("p99_itl_ms") and both[1].get("output_throughput"):
        lines.append(
            f"  colocated / disaggregated: ITL p99 {both[0]['p99_itl_ms'] / both[1]['p99_itl_ms']:.2f}x, "
            f"output throughput {both[1]['output_throughput'] / both[0]['output_throughput']:.2f}x of colocated"
        )
    counters = out / "disagg-itl-consumer-counters.txt"
    if counters.is_file():
        # "tokenmill:kv_transfer_hits_total{model_name=...} 896.0" -> "hits_total 896"
        pairs = []
        for line in counters.read_text().splitlines():
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0].removeprefix("tokenmill:kv_transfer_")
            if name != "info":
                pairs.append(f"{name} {float(value):g}")
        lines.append("  consumer: " + ", ".join(pairs))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="the OUT folder benchmarks/kv_tier_gpu.sh wrote")
    out = parser.parse_args().out_dir
    if not out.is_dir():
        parser.error(f"{out} is not a folder; give the OUT folder of a benchmarks/kv_tier_gpu.sh run")
    copies = [
        line
        for path in sorted(out.glob("kv-tier-copies-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        for line in copy_lines(json.loads(path.read_text())["metrics"], "8B-shaped pools")
    ]
    print("\n".join([*copies, *tier_lines(_load(out / "kv-tier-offload.json")), *disagg_lines(out)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
