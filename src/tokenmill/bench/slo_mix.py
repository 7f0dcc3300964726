"""`bench serve` with SLO classes: a priority per request drawn from a mix, and per-class SLO
attainment and goodput computed from what the client measured.

`--priority-mix 0:0.3,1:0.7` gives 30 % of the requests priority 0 and 70 % priority 1 (the
request body's `priority`, unless `--no-priority-field`: then the classes only group the
report, for a server whose policy takes no priority). `--slo-classes 0=1500/300,1=8000/600`
(the syntax of the server's `--slo-class`, targets in ms: TTFT / TPOT) are the targets each class
is judged by. A request meets its SLO when it completed with a client-measured TTFT and TPOT
within its class's targets; a 429 (shed by the slo policy, or refused by admission control)
misses it. Goodput is the requests that met their SLO, per second of the run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.bench.serve_metrics import RequestResult
from tokenmill.slo import parse_slo_classes


def parse_priority_mix(text: str) -> list[tuple[int, float]]:
    """ "0:0.3,1:0.7" -> [(0, 0.3), (1, 0.7)]; the weights are normalised."""
    mix: list[tuple[int, float]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        priority, sep, weight = item.partition(":")
        try:
            entry = (int(priority), float(weight))
        except ValueError:
            entry = (0, -1.0)
        if not sep or not entry[1] > 0:
            raise ValueError(f"bad --priority-mix item {item!r}: expected PRIORITY:WEIGHT, e.g. 0:0.3")
        mix.append(entry)
    if not mix:
        raise ValueError(f"--priority-mix names no priority: {text!r}")
    return mix


def assign_priorities(num_requests: int, mix: list[tuple[int, float]], seed: int) -> list[int]:
    """Each request's priority, drawn from the mix with its own seed (the same in every run)."""
    priorities = [p for p, _ in mix]
    weights = np.array([w for _, w in mix], dtype=float)
    rng = np.random.default_rng(seed + 2)
    return [int(p) for p in rng.choice(priorities, size=num_requests, p=weights / weights.sum())]


def slo_report(
    results: list[RequestResult], priorities: list[int], classes_text: str | None, duration_s: float
) -> dict[str, Any]:
    """Per class (priority): sent, completed, 429s, met; attainment = met / sent; and goodput."""
    targets = {p: (ttft, tpot) for p, ttft, tpot in parse_slo_classes(classes_text)} if classes_text else {}
    by_class: dict[str, dict[str, Any]] = {}
    total_met = 0
    for result, priority in zip(results, priorities, strict=True):
        row = by_class.setdefault(str(priority), {"sent": 0, "completed": 0, "rejected_429": 0, "met": 0})
        row["sent"] += 1
        if result.success:
            row["completed"] += 1
        elif result.error.startswith("HTTP 429"):
            row["rejected_429"] += 1
        if result.success and _met(result, targets.get(priority)):
            row["met"] += 1
            total_met += 1
    for priority, row in by_class.items():
        row["attainment"] = row["met"] / row["sent"]
        ttft, tpot = targets.get(int(priority), (None, None))
        row["ttft_target_ms"], row["tpot_target_ms"] = ttft, tpot
    return {
        "classes": dict(sorted(by_class.items())),
        "goodput_requests": total_met,
        "goodput_rps": total_met / duration_s if duration_s > 0 else 0.0,
        "attainment": total_met / len(results) if results else 0.0,
    }


def _met(result: RequestResult, target: tuple[float | None, float | None] | None) -> bool:
    if target is None:
        return True
    ttft_ms, tpot_ms = target
    if ttft_ms is not None and result.ttft * 1000 > ttft_ms:
        return False
    tpot = result.tpot
    return tpot_ms is None or tpot is None or tpot * 1000 <= tpot_ms


def format_slo_report(report: dict[str, Any]) -> str:
    lines = [f"{' SLO attainment ':=^50}"]
    for priority, row in report["classes"].items():
        lines.append(
            f"priority {priority:>3}: {row['met']:>4}/{row['sent']:<4} met ({row['attainment']:.0%}), "
            f"{row['completed']} completed, {row['rejected_429']} x 429"
        )
    lines.append(f"goodput: {report['goodput_requests']} requests, {report['goodput_rps']:.2f} req/s")
    return "\n".join(lines)
