"""The quality gate's report as a plain-text table (what `tokenmill quality-gate` prints and what
`serve --quality-gate` puts in its refusal) and as JSON (`--json`)."""

from __future__ import annotations

import json
import math

from tokenmill.quality.gate import GateReport


def _number(value: float | None) -> str:
    if value is None:
        return "not measured"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.6f}" if abs(value) < 1 else f"{value:.4f}"


def format_table(report: GateReport) -> str:
    metrics = report.metrics
    verdict = report.verdict
    rows = [
        ("perplexity, base", _number(metrics.base_perplexity), "", ""),
        ("perplexity, candidate", _number(metrics.candidate_perplexity), "", ""),
    ]
    for check in verdict.checks:
        result = "n/a" if check.value is None else ("pass" if check.passed else "FAIL")
        rows.append((check.label, _number(check.value), f"{check.comparison} {check.limit:g}", result))
    rows.insert(4, ("max KL (one position)", _number(metrics.max_kl), "", ""))
    header = ("metric", "value", "threshold", "result")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    lengths = ", ".join(str(n) for n in metrics.greedy_prefix_lengths) or "-"
    out = [
        f"quality gate: candidate {report.candidate}",
        f"              base      {report.base}",
        f"text set: {metrics.num_windows} windows of up to {report.options.window} tokens, "
        f"{metrics.num_scored_tokens} scored positions; {len(metrics.greedy_prefix_lengths)} greedy "
        f"prompts x {metrics.greedy_tokens} tokens (equal before the first divergence: {lengths})",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
    ]
    if verdict.passed:
        out.append(f"PASSED ({report.seconds:.1f} s)")
    else:
        out.append(f"FAILED: {verdict.describe_failures()}")
    return "\n".join(out)


def format_json(report: GateReport) -> str:
    # NaN / inf are not JSON: they go out as null with the metric named in failed_metrics.
    return json.dumps(_finite(report.to_dict()), indent=2)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
