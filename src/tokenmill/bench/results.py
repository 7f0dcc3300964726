"""One JSON format for every benchmark result, so runs can be compared and reproduced.

Each file records what was measured (`metrics`), with which settings (`config`), on what
hardware (`device`), from which code (`commit`) and how to run it again (`command`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill import envs
from tokenmill.cpu_cores import usable_cores

if TYPE_CHECKING:
    from tokenmill.args import EngineArgs
    from tokenmill.config import EngineConfig

DEFAULT_RESULTS_DIR = "benchmarks/results"


def write_result(
    benchmark: str,
    config: dict[str, Any],
    metrics: dict[str, Any],
    out_dir: str | Path = DEFAULT_RESULTS_DIR,
    name: str | None = None,
) -> Path:
    """Write one result file and return its path.

    `name` is the file name (".json" added when missing); by default `<benchmark>-<UTC time>.json`.
    """
    now = dt.datetime.now(dt.UTC)
    record = {
        "benchmark": benchmark,
        "device": device_name(),
        "command": command_line(),
        "commit": git_commit(),
        "timestamp": now.isoformat(timespec="seconds"),
        "config": _json_safe(config),
        "metrics": _json_safe(metrics),
    }
    if name is None:
        name = f"{benchmark}-{now.strftime('%Y%m%d-%H%M%S')}"
    name = re.sub(r"[^\w.\-]+", "_", name)
    if not name.endswith(".json"):
        name += ".json"
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    return path


def engine_options(engine_args: EngineArgs, engine_config: EngineConfig) -> dict[str, Any]:
    """A result's engine settings: the options as given (flat, as results always had them) and the
    resolved EngineConfig under "engine_config", its `kernel` saying which kernel paths ran."""
    given = {k: v for k, v in engine_args.as_kwargs().items() if v is not None and k != "model"}
    return {**given, "engine_config": dataclasses.asdict(engine_config)}


def command_line() -> str:
    """The command as typed: program name (not its full path) and its quoted arguments."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return shlex.join([program, *sys.argv[1:]])


def device_name() -> str:
    """The GPU's name when one is in use, else the CPU model and its core count."""
    gpu = _gpu_name()
    return gpu if gpu is not None else _cpu_name()


def _gpu_name() -> str | None:
    # Ask torch only when it is already loaded (in-process engines): importing it costs seconds,
    # and a load generator on the same host should not create a CUDA context of its own.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not names:
        return None
    return f"{names[0]} x{len(names)}"


def _cpu_name() -> str:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: fall back to platform's answer below
    if not model:
        import platform

        model = platform.processor() or platform.machine() or "unknown CPU"
    cores = usable_cores()
    return f"{model} ({cores} cores)"


def git_commit() -> str:
    """HEAD of the source checkout, with "+dirty" when tracked files have uncommitted changes.

    $TOKENMILL_COMMIT overrides it: a copy of the tree without .git (the GPU machine gets one) is
    told the commit it was taken from.
    """
    override = envs.TOKENMILL_COMMIT.get()
    if override:
        return override
    repo = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=False
        )

    if shutil.which("git") is None:
        return "unknown"
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status.returncode == 0 and bool(status.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _json_safe(value: Any) -> Any:
    """Plain JSON: inf as the string "inf" (e.g. an unbounded request rate), NaN as null, numpy as Python."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value
