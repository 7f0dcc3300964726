"""Speculative decoding counters, with vLLM's names: what the engine reports in its stats."""

from __future__ import annotations

PER_POSITION_KEY = "spec_decode_num_accepted_tokens_per_pos"


class SpecDecodingStats:
    """Totals since start: drafts (request-steps that verified any), draft tokens, accepted
    tokens, and accepted tokens per draft position (position i counts a request-step whose
    first i + 1 drafts were all accepted)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        for position in range(min(num_accepted, len(per_position))):
            per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying request-step: accepted drafts plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_stats(self) -> dict[str, float]:
        stats = {
            "spec_decode_num_drafts": float(self.num_drafts),
            "spec_decode_num_draft_tokens": float(self.num_draft_tokens),
            "spec_decode_num_accepted_tokens": float(self.num_accepted_tokens),
        }
        for position, count in enumerate(self.accepted_per_position):
            stats[f"{PER_POSITION_KEY}.{position}"] = float(count)
        return stats
