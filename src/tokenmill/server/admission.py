"""Admission control: bounds on the sequences (and their prompt tokens) admitted but not started.

A sequence waits from the moment its request is admitted until its first token comes back; the
server's bookkeeping, not the engine's, so the check is synchronous and a refused request never
reaches the engine. Beyond a bound the client gets 429 with `Retry-After`; a request that could
never pass a bound, even with nothing else waiting, gets 400 instead (retrying would not help).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError, TokenmillError

# What the 429 tells clients to wait. The queue drains at the engine's pace, typically within
# seconds; clients with their own backoff (the openai client) are free to wait longer.
RETRY_AFTER_S = 1


class OverloadedError(TokenmillError):
    """The server is too busy to admit this request now (HTTP 429, with Retry-After)."""

    status_code = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SloShedError(OverloadedError):
    """The `slo` scheduler gave up on a request before it started: it could no longer meet its
    latency target (HTTP 429, with Retry-After). Admitted, so not counted as a refusal: the engine
    counts it (finish_reason "shed")."""

    reached_engine = True


def shed_error(message: str | None, retry_after: float | None) -> SloShedError:
    retry_after_s = max(1, math.ceil(retry_after)) if retry_after is not None else RETRY_AFTER_S
    return SloShedError(message or "shed by the SLO scheduler; retry later", retry_after_s=retry_after_s)


class QueueTimeoutError(TokenmillError):
    """The request waited longer than --max-queue-time without starting (HTTP 503, Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class AdmissionTicket:
    """One admitted request's reservation: (prompt index, sample index) -> prompt tokens, for each
    of its sequences that has not started yet. Releasing twice is harmless."""

    control: AdmissionControl
    waiting: dict[tuple[int, int], int] = field(default_factory=dict)

    def started(self, prompt_index: int, sample_index: int) -> None:
        """The sequence produced its first token (or ended): it no longer waits."""
        tokens = self.waiting.pop((prompt_index, sample_index), None)
        if tokens is not None:
            self.control.num_waiting_seqs -= 1
            self.control.num_waiting_tokens -= tokens

    def is_waiting(self, prompt_index: int, sample_index: int) -> bool:
        return (prompt_index, sample_index) in self.waiting

    def release(self) -> None:
        """The request ended: whatever still waited stops counting."""
        for key in list(self.waiting):
            self.started(*key)


@dataclass
class AdmissionControl:
    max_num_waiting_seqs: int | None = None
    max_num_waiting_tokens: int | None = None
    num_waiting_seqs: int = 0
    num_waiting_tokens: int = 0

    def admit(self, prompt_lens: list[int], n: int) -> AdmissionTicket:
        """Reserves room for `n` sequences of each prompt, or raises (429 busy, 400 never fits)."""
        new_seqs = len(prompt_lens) * n
        new_tokens = sum(prompt_lens) * n
        max_seqs, max_tokens = self.max_num_waiting_seqs, self.max_num_waiting_tokens
        if max_seqs is not None and new_seqs > max_seqs:
            raise InvalidRequestError(
                f"the request has {new_seqs} sequences (prompts x n) but at most {max_seqs} may wait "
                "at once (--max-num-waiting-seqs); send fewer prompts or a smaller n",
                param="n",
            )
        if max_tokens is not None and new_tokens > max_tokens:
            raise InvalidRequestError(
                f"the request's sequences hold {new_tokens} prompt tokens but at most {max_tokens} may "
                "wait at once (--max-num-waiting-tokens); send shorter or fewer prompts, or a smaller n",
                param="prompt",
            )
        if max_seqs is not None and self.num_waiting_seqs + new_seqs > max_seqs:
            raise OverloadedError(
                f"the server is overloaded: {self.num_waiting_seqs} sequences are waiting to start "
                f"(limit {max_seqs}); retry after {RETRY_AFTER_S} s"
            )
        if max_tokens is not None and self.num_waiting_tokens + new_tokens > max_tokens:
            raise OverloadedError(
                f"the server is overloaded: {self.num_waiting_tokens} prompt tokens are waiting to "
                f"start (limit {max_tokens}); retry after {RETRY_AFTER_S} s"
            )
        ticket = AdmissionTicket(self)
        for i, prompt_len in enumerate(prompt_lens):
            for j in range(n):
                ticket.waiting[(i, j)] = prompt_len
        self.num_waiting_seqs += new_seqs
        self.num_waiting_tokens += new_tokens
        return ticket
