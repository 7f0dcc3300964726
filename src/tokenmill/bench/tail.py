"""Where the slowest requests' time went: the client's times joined with the server's trace.

`bench serve --server-trace-dir DIR` (the server started with `--trace-dir DIR` on the same host)
reads DIR/requests.jsonl and DIR/steps.jsonl (engine/step_trace.py) after a run and splits each
request's time to first token into stages, all on the host's monotonic clock:

  api_in         sent by the client -> tokenized and admitted by the API server (HTTP, tokenizer)
  to_engine      -> taken off the socket by the engine core
  queued         -> its first prefill chunk was scheduled
  prefill        -> its first token reached the engine's host side (every chunk and the steps
                    between them)
  engine_to_api  -> the API server processed that token
  api_to_client  -> the client read the first chunk (SSE formatting, the event loop, the socket)

For the slowest 1 % by TTFT it also lists what the engine did meanwhile: the steps that ran
between the request's arrival in the engine and its first token, their prefill tokens, the
longest step gap, Triton JIT compiles (by kernel) and GC pauses. For the slowest 1 % by TPOT the
same over its decode. The run's steps are summarised by kind (decode-only in a CUDA graph, eager
decode-only, with prefill).

The join key is the response's `id` plus "-p0" (the engine id of a single-prompt request's only
sequence, server/serving_common.py).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any

import numpy as np

from tokenmill.bench.serve_metrics import RequestResult

REQUESTS_FILE = "requests.jsonl"  # engine/trace_files.py's names (bench imports no engine code)
STEPS_FILE = "steps.jsonl"
TAIL_FRACTION = 0.01
TRACE_SETTLE_S = 1.0  # an idle engine flushes its step records every 0.5 s (engine/core_process.py)
MAX_LISTED = 10
TTFT_STAGES = ("api_in", "to_engine", "queued", "prefill", "engine_to_api", "api_to_client")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the last line of a file still being written
    return records


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def ttft_stages(result: RequestResult, trace: dict[str, Any]) -> dict[str, float] | None:
    """The request's TTFT split into TTFT_STAGES (ms); None if the trace lacks a stamp."""
    chunks = trace.get("prefill_chunks") or []
    first_token = trace.get("first_token") or 0.0
    api_first = trace.get("api_first_output")
    if not chunks or not first_token or api_first is None:
        return None
    sent = result.sent_monotonic
    first_chunk_read = sent + result.ttft
    points = (sent, trace["arrival"], trace["received"], chunks[0][0], first_token, api_first, first_chunk_read)
    return {name: _ms(b - a) for name, a, b in zip(TTFT_STAGES, points[:-1], points[1:], strict=True)}


class StepIndex:
    """The run's step records in order, with each step's gap: its results' arrival after the
    previous step's, or after its own start when the engine was idle before it (what one step
    costs every request in it)."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.steps = sorted(steps, key=lambda s: s["done"])
        self.done = np.array([s["done"] for s in self.steps])
        if self.steps:
            start = np.array([s["start"] for s in self.steps])
            previous = np.concatenate([[start[0]], self.done[:-1]])
            self.gap = self.done - np.maximum(previous, start)
        else:
            self.gap = np.array([])

    def between(self, start: float, end: float) -> range:
        """Indices of the steps whose results arrived in (start, end]."""
        lo = int(np.searchsorted(self.done, start, side="right"))
        hi = int(np.searchsorted(self.done, end, side="right"))
        return range(lo, hi)

    def describe(self, start: float, end: float) -> dict[str, Any]:
        idx = self.between(start, end)
        steps = [self.steps[i] for i in idx]
        compiles = [c for s in steps for c in s.get("compiles", [])]
        gc_pauses = [g for s in steps for g in s.get("gc", [])]
        gaps = [self.gap[i] for i in idx]
        return {
            "steps": len(steps),
            "steps_with_prefill": sum(1 for s in steps if s["prefill_tokens"] > 0),
            "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
            "longest_step_gap_ms": _ms(max(gaps)) if gaps else 0.0,
            "longest_step_tokens": max((s["tokens"] for s in steps), default=0),
            "jit_compiles": len(compiles),
            "jit_compile_ms": _ms(sum(c[2] for c in compiles)),
            "jit_kernels": sorted({c[0] for c in compiles}),
            "gc_pause_ms": _ms(sum(g[1] for g in gc_pauses)),
        }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p99": round(float(np.percentile(arr, 99)), 3),
        "max": round(float(arr.max()), 3),
    }


def step_summary(index: StepIndex) -> dict[str, Any]:
    """Step gaps (ms) by kind, and the run's compiles and engine GC pauses."""
    kinds: dict[str, list[float]] = {"graph_decode": [], "eager_decode": [], "with_prefill": []}
    for step, gap in zip(index.steps, index.gap, strict=True):
        if step["prefill_tokens"] > 0:
            kinds["with_prefill"].append(gap * 1000)
        elif step.get("graph", 0) > 0:
            kinds["graph_decode"].append(gap * 1000)
        else:
            kinds["eager_decode"].append(gap * 1000)
    compiles = [c for s in index.steps for c in s.get("compiles", [])]
    gc_pauses = [g for s in index.steps for g in s.get("gc", [])]
    host = [(s["launched"] - s["start"]) * 1000 for s in index.steps]
    return {
        "num_steps": len(index.steps),
        "gap_ms": {kind: {"count": len(v), **_percentiles(v)} for kind, v in kinds.items()},
        "host_ms_before_launch": _percentiles(host),
        "mean_reqs_per_step": round(float(np.mean([s["reqs"] for s in index.steps])), 2) if index.steps else 0.0,
        "jit_compiles": len(compiles),
        "jit_compile_ms": _ms(sum(c[2] for c in compiles)),
        "jit_compiles_by_kernel": dict(Counter(c[0] for c in compiles).most_common(10)),
        "engine_gc_pauses": len(gc_pauses),
        "engine_gc_pause_ms": _percentiles([g[1] * 1000 for g in gc_pauses]),
    }


def _slowest(results: list[RequestResult], key, fraction: float) -> list[RequestResult]:
    ranked = sorted((r for r in results if key(r) is not None), key=key, reverse=True)
    return ranked[: max(1, math.ceil(fraction * len(ranked)))] if ranked else []


def tail_report(
    results: list[RequestResult], trace_dir: str, fraction: float = TAIL_FRACTION
) -> dict[str, Any]:
    """The breakdown of the slowest `fraction` of `results` (by TTFT and by TPOT) from the trace."""
    ok = [r for r in results if r.success and r.response_id]
    if not ok:
        return {"error": "no successful request carried a response id"}
    start = min(r.sent_monotonic for r in ok)
    end = max(r.sent_monotonic + r.latency for r in ok)
    request_log = read_jsonl(os.path.join(trace_dir, REQUESTS_FILE))
    traces = {
        rec["id"]: rec
        for rec in request_log
        if rec.get("kind") == "request" and start - 1.0 <= rec.get("arrival", 0.0) <= end
    }
    api_gc = [rec for rec in request_log if rec.get("kind") == "gc" and start <= rec["start"] <= end]
    steps = [s for s in read_jsonl(os.path.join(trace_dir, STEPS_FILE)) if start <= s["done"] <= end + 1.0]
    index = StepIndex(steps)
    joined = [(r, traces.get(f"{r.response_id}-p0")) for r in ok]
    found = [(r, t) for r, t in joined if t is not None]
    if not found:
        return {"error": f"none of the {len(ok)} requests is in {trace_dir}/{REQUESTS_FILE}"}
    by_result = {id(r): t for r, t in found}
    stages_all = [s for r, t in found if (s := ttft_stages(r, t)) is not None]

    def ttft_entry(r: RequestResult) -> dict[str, Any]:
        t = by_result[id(r)]
        entry = {
            "id": r.response_id,
            "ttft_ms": _ms(r.ttft),
            "stages_ms": ttft_stages(r, t),
            "prefill_chunks": len(t.get("prefill_chunks") or []),
            "preemptions": len(t.get("preempted") or []),
        }
        entry["while_waiting"] = index.describe(t["received"], t.get("first_token") or t["received"])
        return entry

    def tpot_entry(r: RequestResult) -> dict[str, Any]:
        t = by_result[id(r)]
        return {
            "id": r.response_id,
            "tpot_ms": _ms(r.tpot or 0.0),
            "output_tokens": r.output_tokens,
            "preemptions": len(t.get("preempted") or []),
            "while_decoding": index.describe(t.get("first_token") or t["received"], t.get("finished") or end),
        }

    ttft_tail = _slowest([r for r, _ in found], lambda r: r.ttft, fraction)
    tpot_tail = _slowest([r for r, _ in found], lambda r: r.tpot, fraction)
    tail_stages = [e["stages_ms"] for e in map(ttft_entry, ttft_tail) if e["stages_ms"]]
    return {
        "fraction": fraction,
        "requests_traced": len(found),
        "requests_untraced": len(ok) - len(found),
        "ttft_stage_ms_p50_all": {k: round(float(np.median([s[k] for s in stages_all])), 3) for k in TTFT_STAGES}
        if stages_all
        else {},
        "ttft_stage_ms_mean_tail": {k: round(float(np.mean([s[k] for s in tail_stages])), 3) for k in TTFT_STAGES}
        if tail_stages
        else {},
        "slowest_ttft": [ttft_entry(r) for r in ttft_tail[:MAX_LISTED]],
        "slowest_tpot": [tpot_entry(r) for r in tpot_tail[:MAX_LISTED]],
        "steps": step_summary(index) if index.steps else {},
        "api_gc_pauses": len(api_gc),
        "api_gc_pause_ms": _percentiles([g["seconds"] * 1000 for g in api_gc]),
    }


def format_tail(report: dict[str, Any]) -> str:
    """A few lines for the console: the stage means of the TTFT tail against the median request."""
    if "error" in report:
        return f"tail breakdown: {report['error']}"
    lines = [f"{'Slowest 1% (trace)':-^50}"]
    p50, tail = report["ttft_stage_ms_p50_all"], report["ttft_stage_ms_mean_tail"]
    for stage in TTFT_STAGES:
        lines.append(f"TTFT {stage + ' (ms):':<24}{p50.get(stage, 0.0):>10.2f} p50  {tail.get(stage, 0.0):>10.2f} tail")
    if report["slowest_ttft"]:
        worst = report["slowest_ttft"][0]["while_waiting"]
        lines.append(
            f"slowest TTFT waited {worst['steps']} steps ({worst['steps_with_prefill']} with prefill, "
            f"longest gap {worst['longest_step_gap_ms']:.1f} ms, {worst['jit_compiles']} JIT compiles, "
            f"GC {worst['gc_pause_ms']:.1f} ms)"
        )
    steps = report.get("steps") or {}
    if steps:
        lines.append(
            f"steps: {steps['num_steps']}, JIT compiles {steps['jit_compiles']} ({steps['jit_compile_ms']:.0f} ms), "
            f"engine GC pauses {steps['engine_gc_pauses']}, API GC pauses {report['api_gc_pauses']}"
        )
        for kind, gaps in steps["gap_ms"].items():
            if gaps["count"]:
                lines.append(f"  {kind:<14} {gaps['count']:>6} steps, gap p50 {gaps['p50']:.2f} p99 {gaps['p99']:.2f} max {gaps['max']:.2f} ms")
    return "\n".join(lines)
