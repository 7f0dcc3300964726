"""A request's latency targets (SLO): which apply, and whether a finished request met them.

Pure Python, below core/: the scheduler's `slo` policy (core/slo_queue.py), the API server and the load
generator all read these. A request's targets are its own `slo_ttft_ms` / `slo_tpot_ms`
(SamplingParams), else its priority's class (`--slo-class`), else the server's defaults
(`--slo-ttft-ms`, `--slo-tpot-ms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.config import SloConfig


@dataclass(frozen=True, slots=True)
class SloTarget:
    ttft_s: float | None  # None: no time-to-first-token target
    tpot_s: float | None  # None: no time-per-output-token target
    slo_class: str  # the metrics label: the priority that picked a class, or "default"

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """True when a request with this TTFT and mean time per output token (None: one token
        only) met every target it has."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


def resolve_target(
    config: SloConfig, priority: int, ttft_ms: float | None, tpot_ms: float | None
) -> SloTarget:
    """The targets that apply to a request: its own fields, else its priority's class, else the defaults."""
    class_ttft = class_tpot = None
    slo_class = "default"
    for class_priority, ttft, tpot in config.classes:
        if class_priority == priority:
            class_ttft, class_tpot, slo_class = ttft, tpot, str(priority)
            break
    ttft = _first(ttft_ms, class_ttft, config.ttft_ms)
    tpot = _first(tpot_ms, class_tpot, config.tpot_ms)
    return SloTarget(
        ttft_s=None if ttft is None else ttft / 1000.0,
        tpot_s=None if tpot is None else tpot / 1000.0,
        slo_class=slo_class,
    )


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def parse_slo_classes(text: str) -> tuple[tuple[int, float | None, float | None], ...]:
    """`--slo-class` values: comma-separated `PRIORITY=TTFT_MS/TPOT_MS` (either target may be left
    empty, e.g. `1=5000/` or `2=/300`), e.g. `0=500/50,1=5000/200`."""
    classes: list[tuple[int, float | None, float | None]] = []
    seen: set[int] = set()
    for entry in filter(None, (part.strip() for part in text.split(","))):
        priority_text, sep, targets = entry.partition("=")
        ttft_text, slash, tpot_text = targets.partition("/")
        if not sep or not slash:
            raise ValueError(
                f"an SLO class is PRIORITY=TTFT_MS/TPOT_MS (e.g. 0=500/50, or 1=5000/ for a TTFT target "
                f"only), got {entry!r}"
            )
        try:
            priority = int(priority_text)
        except ValueError:
            raise ValueError(f"an SLO class's priority must be an integer, got {priority_text!r} in {entry!r}") from None
        if priority in seen:
            raise ValueError(f"priority {priority} has two SLO classes; give each priority one")
        seen.add(priority)
        ttft, tpot = _target_ms(ttft_text, entry), _target_ms(tpot_text, entry)
        if ttft is None and tpot is None:
            raise ValueError(f"the SLO class {entry!r} sets no target; give a TTFT or a TPOT in ms")
        classes.append((priority, ttft, tpot))
    return tuple(classes)


def _target_ms(text: str, entry: str) -> float | None:
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"SLO targets are milliseconds, got {text!r} in {entry!r}") from None
    check_target_ms("--slo-class", value)
    return value


def check_target_ms(name: str, value: float | None) -> None:
    """A target is a positive, finite number of milliseconds."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")
