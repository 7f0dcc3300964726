"""Where `--trace-dir` puts its files (engine/step_trace.py, engine/request_trace.py; bench/tail.py
reads them by the same names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

STEPS_FILE = "steps.jsonl"
REQUESTS_FILE = "requests.jsonl"


def open_trace_file(trace_dir: str, name: str) -> BinaryIO:
    """`trace_dir/name` opened for appending (the directory made if missing); ValueError naming
    --trace-dir when that cannot be done."""
    try:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        return open(os.path.join(trace_dir, name), "ab")  # noqa: SIM115 - its owner closes it
    except OSError as exc:
        raise ValueError(
            f"--trace-dir {trace_dir!r} cannot hold the trace ({exc.strerror or exc}); "
            "pass a directory this user can create and write"
        ) from exc
