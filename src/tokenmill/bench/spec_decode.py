"""Speculative decoding in a benchmark result: what the engine's counters gained over the run.

Two sources give the same totals: an in-process engine's stats (`bench latency`, `bench
throughput`: keys like "spec_decode_num_drafts" and "spec_decode_num_accepted_tokens_per_pos.0")
and a server's /metrics (`bench serve`: "tokenmill:spec_decode_num_drafts_total", the per-position
counter with a `position` label; vLLM's "vllm:" names read the same). Both become stats-keyed
totals here; a summary is the difference of two readings, taken before and after the measured run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tokenmill.bench.prometheus_text import Samples
from tokenmill.metrics import SPEC_DECODE_COUNTERS, SPEC_DECODE_PER_POSITION

DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens"
# Any prefix ("tokenmill:", "vllm:"), the counter's name, the `_total` Prometheus adds.
_COUNTER_SAMPLE = re.compile(r"^(?:.*:)?(spec_decode_[a-z_]+)_total$")


def spec_decode_totals(stats: Mapping[str, Any]) -> dict[str, float]:
    """The speculative decoding entries of an engine's stats (empty when it does not speculate)."""
    per_position = SPEC_DECODE_PER_POSITION + "."
    return {
        key: float(value)
        for key, value in stats.items()
        if key in SPEC_DECODE_COUNTERS or key.startswith(per_position)
    }


def totals_from_samples(samples: Samples | None) -> dict[str, float]:
    """Stats-keyed totals from a parsed /metrics, each summed over its label sets (models, engines)
    but the draft position; empty when the server exports no speculative decoding counters."""
    totals: dict[str, float] = {}
    for name, series in (samples or {}).items():
        match = _COUNTER_SAMPLE.match(name)
        if match is None:
            continue
        counter = match.group(1)
        for labels, value in series:
            if counter == SPEC_DECODE_PER_POSITION and "position" in labels:
                key = f"{counter}.{labels['position']}"
            elif counter in SPEC_DECODE_COUNTERS:
                key = counter
            else:
                continue
            totals[key] = totals.get(key, 0.0) + value
    return totals


def spec_decode_summary(before: Mapping[str, float] | None, after: Mapping[str, float]) -> dict[str, Any] | None:
    """What the counters gained from `before` to `after` (both stats-keyed totals); None when
    `after` has none (speculation off). Without a `before` the whole `after` counts.

    acceptance_rate = accepted / draft tokens; mean_acceptance_length = 1 + accepted / drafts
    (tokens per verifying request-step, the target's own token included); per position i, the
    request-steps whose first i + 1 drafts were all accepted, as a count and as a share of drafts.
    """
    if DRAFTS not in after:
        return None
    before = before or {}

    def gained(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, draft_tokens, accepted = gained(DRAFTS), gained(DRAFT_TOKENS), gained(ACCEPTED_TOKENS)
    prefix = SPEC_DECODE_PER_POSITION + "."
    positions = sorted(int(key[len(prefix) :]) for key in after if key.startswith(prefix))
    per_position = [gained(f"{prefix}{i}") for i in positions]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
        "accepted_per_position": per_position,
        "acceptance_rate_per_position": [n / drafts if drafts > 0 else None for n in per_position],
    }


def format_spec_decode(summary: Mapping[str, Any]) -> str:
    """A few report lines in the layout of `format_report`."""

    def number(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = ["{s:{c}^50}".format(s=" Speculative Decoding ", c="-")]
    rows = (
        ("Drafts:", number(summary["drafts"], ".0f")),
        ("Draft tokens:", number(summary["draft_tokens"], ".0f")),
        ("Accepted tokens:", number(summary["accepted_tokens"], ".0f")),
        ("Acceptance rate:", number(summary["acceptance_rate"], ".3f")),
        ("Mean acceptance length:", number(summary["mean_acceptance_length"], ".2f")),
        (
            "Acceptance per position:",
            " ".join(number(r, ".2f") for r in summary["acceptance_rate_per_position"]) or "n/a",
        ),
    )
    lines += [f"{label:<26}{value:>24}" for label, value in rows]
    return "\n".join(lines)
