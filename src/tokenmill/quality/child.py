"""The quality gate's child process of `serve --quality-gate` (quality/serve_gate.py): settings
as JSON on stdin, the report as JSON (NaN kept as NaN, which Python's json reads back) into the
file the settings name. Exit status 0 when a report was written, whatever its verdict."""

from __future__ import annotations

import json
import logging
import sys

from tokenmill.args import EngineArgs
from tokenmill.quality.gate import GatePlan, run_gate
from tokenmill.quality.text_set import TextSetOptions
from tokenmill.quality.verdict import Thresholds


def main() -> int:
    settings = json.loads(sys.stdin.read())
    logging.basicConfig(
        level=settings["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    plan = GatePlan(EngineArgs(**settings["candidate"]), EngineArgs(**settings["base"]))
    report = run_gate(plan, TextSetOptions(**settings["options"]), Thresholds(**settings["thresholds"]))
    with open(settings["report_path"], "w", encoding="utf-8") as out:
        json.dump(report.to_dict(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
