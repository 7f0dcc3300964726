"""The table of a serve_tail_sweep.sh run, from its result files (markdown, for BENCHMARKS.md).

    python benchmarks/serve_tail_summary.py benchmarks/results/serve-tail-llama-3.1-8b-h100-rate-*-0c78bdb.json
"""

from __future__ import annotations

import argparse
import json
import math


def _rate(result: dict) -> float:
    rate = result["config"].get("request_rate", math.inf)
    return math.inf if rate in (None, "inf") else float(rate)


def row(result: dict) -> str:
    m = result["metrics"]
    tail = m.get("tail") or {}
    steps = tail.get("steps") or {}
    rate = _rate(result)
    label = "inf" if math.isinf(rate) else f"{rate:g}"
    return (
        f"| {label} | {m['output_throughput']:,.0f} | {m['median_ttft_ms']:,.0f} / {m['p99_ttft_ms']:,.0f} | "
        f"{m['median_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | {m['p99_itl_ms']:,.0f} | "
        f"{steps.get('jit_compiles', 'n/a')} | {m['failed']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="serve-tail result JSON files of one sweep")
    paths = parser.parse_args().results
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    results.sort(key=_rate)
    print("| rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p99 (ms) | JIT compiles | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(row(result))


if __name__ == "__main__":
    main()
