"""Where each SLO class's time to first token went, from a server's `--trace-dir` (requests.jsonl).

benchmarks/slo_overload.py runs each policy's server with a trace dir and, after each run, splits the
engine-side TTFT of that run's requests by priority (RequestTimeline.priority) into stages:

  to_engine  the HTTP request reached the API server's route (its arrival: body, parsing, tokenizing
             follow) -> the engine core took it off its socket
  queued     -> its first prefill chunk was scheduled (waiting for a seat, for the budget, behind others)
  prefill    -> its first token reached the engine's host side (its chunks and the steps around them)

plus `ttft` (the sum) and `tpot` (first token -> finished, per later token; a preemption's
recompute falls in it)

and counts the requests shed, preempted, and the preemptions. Medians and 90th percentiles in ms.
The engine's own clock (time.monotonic(), one per host) on every stamp.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np

REQUESTS_FILE = "requests.jsonl"  # engine/trace_files.py's name (bench imports no engine code)
STAGES = ("to_engine", "queued", "prefill", "ttft", "tpot")


def read_requests(trace_dir: str, since: float) -> list[dict]:
    """The request records of requests that arrived at or after `since` (monotonic seconds)."""
    path = os.path.join(trace_dir, REQUESTS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "request" and record.get("arrival", 0.0) >= since:
                records.append(record)
    return records


def ttft_stages_by_class(records: list[dict]) -> dict[str, dict]:
    by_class: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_class[str(record.get("priority", 0))].append(record)
    report: dict[str, dict] = {}
    for slo_class, group in sorted(by_class.items()):
        samples: dict[str, list[float]] = {stage: [] for stage in STAGES}
        for r in group:
            chunks = r.get("prefill_chunks") or []
            if not r.get("first_token") or not chunks:
                continue
            first_chunk = chunks[0][0]
            samples["to_engine"].append(r["received"] - r["arrival"])
            samples["queued"].append(first_chunk - r["received"])
            samples["prefill"].append(r["first_token"] - first_chunk)
            samples["ttft"].append(r["first_token"] - r["arrival"])
            if r.get("output_tokens", 0) > 1 and r.get("finished"):
                samples["tpot"].append((r["finished"] - r["first_token"]) / (r["output_tokens"] - 1))
        entry: dict = {
            "requests": len(group),
            "shed": sum(r.get("finish_reason") == "shed" for r in group),
            "preempted_requests": sum(bool(r.get("preempted")) for r in group),
            "preemptions": sum(len(r.get("preempted") or ()) for r in group),
        }
        for stage, values in samples.items():
            if values:
                entry[f"{stage}_p50_ms"] = float(np.percentile(values, 50) * 1000)
                entry[f"{stage}_p90_ms"] = float(np.percentile(values, 90) * 1000)
        report[slo_class] = entry
    return report


def format_stages(report: dict[str, dict]) -> str:
    lines = []
    for slo_class, e in report.items():
        stages = ", ".join(
            f"{s} {e[f'{s}_p50_ms']:.0f}/{e[f'{s}_p90_ms']:.0f}" for s in STAGES if f"{s}_p50_ms" in e
        )
        lines.append(
            f"  class {slo_class}: {e['requests']} requests, {e['shed']} shed, {e['preempted_requests']} "
            f"preempted ({e['preemptions']}x); engine TTFT stages p50/p90 ms: {stages}"
        )
    return "\n".join(lines)
