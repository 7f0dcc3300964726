"""`tokenmill serve --quality-gate`: the gate runs before the server starts, and a model that fails
it is refused with the table in the error.

The API server process never imports torch, so the gate runs in a child process
(`python -m tokenmill.quality.child`), which loads the two models one after the other and exits,
giving their memory back before the engine process loads the model to serve. The child gets its
settings as JSON on stdin and writes the report as JSON to a file (its stdout and stderr are the
terminal's: the progress shows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.quality.cli import add_gate_args, engine_args_of, gate_settings

PREFIX = "quality-gate-"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quality-gate",
        action="store_true",
        help="before serving, measure the model with these engine options against its base (see "
        "`tokenmill quality-gate`) and refuse to start if a metric is past its threshold",
    )
    add_gate_args(parser, prefix=PREFIX)


def serve_refusal(args: argparse.Namespace) -> str | None:
    """None when the model passes the gate; else why `serve` refuses it, the table included.
    Raises ValueError for flags that are wrong (before any model loads) and RuntimeError when the
    gate could not run."""
    from tokenmill.quality.gate import plan_gate
    from tokenmill.quality.table import format_table
    from tokenmill.server.launch import build_server

    build_server(args)  # every serve flag checked now, not after minutes of measuring
    base, options, thresholds = gate_settings(args, PREFIX)
    options.check()
    thresholds.check()
    plan = plan_gate(engine_args_of(args), base)
    report = run_gate_in_child(plan, options, thresholds, log_level=getattr(args, "log_level", "INFO"))
    table = format_table(report)
    if report.passed:
        print(table, file=sys.stderr, flush=True)
        return None
    return f"the model failed the quality gate ({report.verdict.describe_failures()})\n{table}"


def run_gate_in_child(plan, options, thresholds, log_level: str = "INFO"):
    """The GateReport of `run_gate(plan, options, thresholds)`, run in a child process."""
    from tokenmill.quality.gate import GateReport

    with tempfile.TemporaryDirectory(prefix="tokenmill-quality-gate-") as tmp:
        report_path = Path(tmp) / "report.json"
        payload = {
            "candidate": plan.candidate.as_kwargs(),
            "base": plan.base.as_kwargs(),
            "options": dataclasses.asdict(options),
            "thresholds": dataclasses.asdict(thresholds),
            "report_path": str(report_path),
            "log_level": log_level,
        }
        result = subprocess.run(
            [sys.executable, "-m", "tokenmill.quality.child"], input=json.dumps(payload), text=True
        )
        if result.returncode != 0 or not report_path.is_file():
            raise RuntimeError(
                f"the quality gate could not run (its process exited with status {result.returncode}; "
                "its error is above)"
            )
        return GateReport.from_dict(json.loads(report_path.read_text()))
