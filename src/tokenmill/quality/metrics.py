"""What the quality gate measures, candidate against base, over the text set (quality/measure.py
computes it; docs/QUALITY_GATE.md explains each number). Torch-free: the verdict, the table and
the API server's `serve --quality-gate` read these without loading a model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GateMetrics:
    # exp(mean negative log-likelihood of each window's next tokens), per model.
    base_perplexity: float
    candidate_perplexity: float
    # KL(base || candidate) of the next-token distributions over the full vocabulary, in nats:
    # the mean over every scored position, and the largest one position has.
    mean_kl: float
    max_kl: float
    # Fraction of scored positions where both models' most likely next token is the same.
    top1_agreement: float
    # Greedy continuations from the prompts, each model its own: per prompt, the tokens equal up to
    # the first one that differs, over the tokens generated; the mean over the prompts. None when
    # no prompts were continued.
    greedy_agreement: float | None
    greedy_prefix_lengths: tuple[int, ...]  # per prompt: the tokens equal before the first divergence
    num_windows: int
    num_scored_tokens: int
    greedy_tokens: int

    @property
    def perplexity_ratio(self) -> float:
        """candidate / base perplexity (> 1: the candidate predicts the text worse)."""
        if self.base_perplexity == 0 or not math.isfinite(self.base_perplexity):
            return math.nan
        return self.candidate_perplexity / self.base_perplexity

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["greedy_prefix_lengths"] = list(self.greedy_prefix_lengths)
        data["perplexity_ratio"] = self.perplexity_ratio
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateMetrics:
        fields = {k: v for k, v in data.items() if k != "perplexity_ratio"}
        fields["greedy_prefix_lengths"] = tuple(fields["greedy_prefix_lengths"])
        return cls(**fields)


def greedy_agreement(base: list[list[int]], candidate: list[list[int]]) -> tuple[float | None, list[int]]:
    """(the mean fraction of tokens equal before the first divergence, each prompt's count)."""
    lengths = []
    for b, c in zip(base, candidate, strict=True):
        same = 0
        for x, y in zip(b, c, strict=False):
            if x != y:
                break
            same += 1
        lengths.append(same)
    if not lengths:
        return None, []
    fractions = [n / max(len(b), 1) for n, b in zip(lengths, base, strict=True)]
    return sum(fractions) / len(fractions), lengths
