"""Thresholds and the verdict: which measured numbers are past their limits.

The defaults (docs/QUALITY_GATE.md gives the measurements behind them): `--quantization fp8` of
the 135M-parameter default model measures a perplexity ratio of 1.004, mean KL 0.019 nats, top-1
agreement 0.92 and greedy agreement 0.50, inside every limit with room; one tensor with scales
1.5x too large (a broken quantization) measures 1.20, 0.19, 0.80 and 0.19, past all four, as does
uncalibrated 4-bit rounding of that small model. A NaN fails every threshold it meets.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.quality.metrics import GateMetrics


@dataclass(frozen=True, slots=True)
class Thresholds:
    max_perplexity_ratio: float = 1.10  # candidate perplexity at most 10 % above the base's
    max_mean_kl: float = 0.10  # nats per token
    min_top1_agreement: float = 0.85
    min_greedy_agreement: float = 0.25  # of the greedy tokens, before the first divergence (mean)

    def check(self) -> None:
        for name, value in asdict(self).items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"threshold {name} must be a finite number >= 0, got {value}")
        for name in ("min_top1_agreement", "min_greedy_agreement"):
            if getattr(self, name) > 1:
                raise ValueError(f"threshold {name} is a fraction in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Check:
    """One thresholded metric: its value, the limit, and whether it holds."""

    metric: str  # GateMetrics' name for it
    label: str  # what the table calls it
    value: float | None  # None: not measured (no greedy prompts)
    comparison: str  # "<=" or ">="
    limit: float

    @property
    def passed(self) -> bool:
        if self.value is None:
            return True
        # Written so that NaN fails: every comparison with NaN is False.
        return self.value <= self.limit if self.comparison == "<=" else self.value >= self.limit


@dataclass(frozen=True, slots=True)
class Verdict:
    checks: tuple[Check, ...]
    failures: tuple[Check, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", tuple(c for c in self.checks if not c.passed))

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe_failures(self) -> str:
        """'mean KL 0.42 > 0.1; top-1 agreement 0.61 < 0.85' (empty when it passed)."""
        flipped = {"<=": ">", ">=": "<"}
        return "; ".join(
            f"{c.label} {c.value:.4g} {flipped[c.comparison]} {c.limit:g} ({c.metric})" for c in self.failures
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": [{**asdict(c), "passed": c.passed} for c in self.checks],
            "failed_metrics": [c.metric for c in self.failures],
        }


def judge(metrics: GateMetrics, thresholds: Thresholds) -> Verdict:
    return Verdict(
        (
            Check("perplexity_ratio", "perplexity ratio", metrics.perplexity_ratio, "<=",
                  thresholds.max_perplexity_ratio),
            Check("mean_kl", "mean KL", metrics.mean_kl, "<=", thresholds.max_mean_kl),
            Check("top1_agreement", "top-1 agreement", metrics.top1_agreement, ">=",
                  thresholds.min_top1_agreement),
            Check("greedy_agreement", "greedy agreement", metrics.greedy_agreement, ">=",
                  thresholds.min_greedy_agreement),
        )
    )  # fmt: skip
