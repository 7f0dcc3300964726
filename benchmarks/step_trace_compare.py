"""Compare the step traces of runs of one workload (`--trace-dir` of `bench throughput` and of
`tokenmill serve`): where each run's device time went, per request.

    python benchmarks/step_trace_compare.py offline=trace-offline/steps.jsonl serve=trace-rate-48/steps.jsonl@256

For each trace (steps with a launch and results only; `PATH@N` keeps the steps with at least N
requests running, e.g. a serving run's window with every seat taken):
- span, and device idle: the time from a step's results to the next step's launch where positive;
- decode-only steps: their number and mean gap (results to results);
- steps with prompt tokens: what a prompt token costs in them, counting each decode row beside it
  at the decode-only steps' cost a row; the span per admitted request;
- decode rows per step against requests running (a row not computed is a seat left idle), and the
  garbage-collection pauses by generation.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict


def load_steps(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return sorted((s for s in steps if s.get("launched") and s.get("done")), key=lambda s: s["step"])


def summarize(steps: list[dict]) -> dict[str, float]:
    span = steps[-1]["done"] - steps[0]["start"]
    idle = sum(max(0.0, b["launched"] - a["done"]) for a, b in zip(steps, steps[1:], strict=False))
    decode_gaps, mixed = [], []
    for a, b in zip(steps, steps[1:], strict=False):
        gap = b["done"] - a["done"]
        decode_rows = b["tokens"] - b["prefill_tokens"]
        if b["prefill_tokens"]:
            mixed.append((gap, b["prefill_tokens"], decode_rows))
        else:
            decode_gaps.append(gap)
    out = {
        "steps": len(steps),
        "span_s": span,
        "device_idle_s": idle,
        "decode_only_steps": len(decode_gaps),
        "decode_only_gap_ms": 1e3 * statistics.fmean(decode_gaps) if decode_gaps else float("nan"),
        "decode_rows_per_step": statistics.fmean(s["tokens"] - s["prefill_tokens"] for s in steps),
        "running_per_step": statistics.fmean(s["running"] for s in steps),
        "new_requests_per_step": statistics.fmean(s["new_reqs"] for s in steps),
        "prompt_tokens": sum(s["prefill_tokens"] for s in steps),
    }
    if mixed and decode_gaps:
        # A decode row costs in a step with prompt tokens what it costs in a decode-only step (its
        # gap over its rows); the rest of the step is the prompt tokens'.
        decode_rows_only = statistics.fmean(b["tokens"] for b in steps if not b["prefill_tokens"])
        per_row = statistics.fmean(decode_gaps) / decode_rows_only
        prompt_time = sum(gap - rows * per_row for gap, _tokens, rows in mixed)
        out |= {
            "steps_with_prompt_tokens": len(mixed),
            "time_in_steps_with_prompt_tokens_s": sum(gap for gap, _t, _r in mixed),
            "us_per_decode_row": 1e6 * per_row,
            "us_per_prompt_token": 1e6 * prompt_time / sum(tokens for _g, tokens, _r in mixed),
        }
    admitted = sum(s["new_reqs"] for s in steps)
    out["ms_per_admitted_request"] = 1e3 * span / admitted if admitted else float("nan")
    gc_by_gen: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        for _start, seconds, generation in s.get("gc", []):
            gc_by_gen[generation].append(seconds)
    for gen, pauses in sorted(gc_by_gen.items()):
        out[f"gc_gen{gen}_pauses"] = len(pauses)
        out[f"gc_gen{gen}_s"] = sum(pauses)
        out[f"gc_gen{gen}_max_ms"] = 1e3 * max(pauses)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "traces", nargs="+", help="NAME=PATH[@N] of a steps.jsonl (or .jsonl.gz); @N: steps with >= N running"
    )
    args = parser.parse_args()
    rows = {}
    for item in args.traces:
        name, _, path = item.partition("=")
        path, _, min_running = path.partition("@")
        steps = load_steps(path)
        if min_running:
            steps = [s for s in steps if s["running"] >= int(min_running)]
        if len(steps) < 2:
            raise SystemExit(f"{name}: fewer than two steps with a launch and results in {path}")
        rows[name] = summarize(steps)
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    print("| | " + " | ".join(rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for key in keys:
        cells = [rows[n].get(key) for n in rows]
        print(
            f"| {key} | "
            + " | ".join(
                "" if c is None else f"{c:,.3f}" if isinstance(c, float) else f"{c:,}" for c in cells
            )
            + " |"
        )


if __name__ == "__main__":
    main()
