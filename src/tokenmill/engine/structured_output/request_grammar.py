"""One constrained request's grammar state: its xgrammar matcher and the start-after gate.

The state lives as long as the request (a preemption keeps it: the output tokens stay, so the
matcher is where it was). `start_after_token_ids` (a reasoning model's end-of-thinking marker)
holds the constraint off until that sequence has appeared in the output; the token after it is
the first one the grammar sees.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.core.request import Request


class RequestGrammar:
    __slots__ = (
        "matcher",
        "start_after",
        "active",
        "error",
        "num_accepted",
        "extra_mask",
        "_terminated",
        "_stop_token_ids",
    )

    def __init__(
        self,
        compiled: Any,
        request: Request,
        extra_mask: np.ndarray | None = None,
        vocab_size: int | None = None,
    ) -> None:
        import xgrammar as xgr

        params = request.sampling_params.structured_outputs
        assert params is not None
        # The model's EOS ids that the grammar's vocabulary holds (a dummy-weights model served with
        # a smaller tokenizer has EOS ids past it); none: the tokenizer's own EOS.
        stop_tokens = [t for t in request.eos_token_ids if vocab_size is None or t < vocab_size] or None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_tokens)
        self.start_after = list(params.start_after_token_ids)
        self.active = not self.start_after
        self.error: str | None = None
        self.num_accepted = 0
        # The matcher's is_terminated() after its last accept: the scheduler's stop check and the
        # next step's fill both ask every step, and only an accept changes the answer (a draft
        # fill's accepts are rolled back before it returns). A matcher made without
        # terminate_without_stop_token ends exactly when it accepts one of its stop tokens, so the
        # answer needs no call into xgrammar either.
        self._terminated = False
        self._stop_token_ids = frozenset(self.matcher.stop_token_ids)
        # A bitmask row ANDed into every row this grammar fills (JSON: no raw control characters).
        self.extra_mask = extra_mask
        if not self.active:  # tokens before a preemption-free start may already hold the marker
            self.active = _ends_with(request.output_token_ids, self.start_after)

    @property
    def needs_mask(self) -> bool:
        """Its next token is constrained."""
        return self.active and self.error is None and not self._terminated

    def accept(self, output_token_ids: list[int], token_id: int) -> str | None:
        """Advance by the request's newest output token; an error message if it is not allowed."""
        if self.error is not None:
            return self.error
        if not self.active:
            self.active = _ends_with(output_token_ids, self.start_after)
            return None
        return self.accepted(self.matcher.accept_token(token_id), token_id)

    def accepted(self, ok: bool, token_id: int) -> str | None:
        """Record the matcher's verdict on `token_id` (from `accept` or a batch accept)."""
        if not ok:
            self.error = (
                f"structured output: the grammar does not allow token {token_id} after "
                f"{self.num_accepted} constrained tokens"
            )
            return self.error
        self.num_accepted += 1
        self._terminated = token_id in self._stop_token_ids
        return None

    def gate_opens_with(self, output_token_ids: list[int], token_id: int) -> None:
        """`accept` for a closed gate, before `token_id` is appended to the output."""
        n = len(self.start_after)
        self.active = self.start_after[-1:] == [token_id] and (
            n == 1 or _ends_with(output_token_ids, self.start_after[:-1])
        )

    @property
    def is_terminated(self) -> bool:
        return self.active and self._terminated

    def fail(self, message: str) -> None:
        """The grammar machinery failed for this request: it ends with `message` when its next
        token comes back (accept returns the error)."""
        if self.error is None:
            self.error = message

    def no_token_allowed(self) -> None:
        """Its filled row allows nothing (bitmask.restrict): the request ends when its sampled
        token comes back."""
        self.error = (
            f"structured output: the grammar allows no token after {self.num_accepted} constrained tokens"
        )


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    n = len(suffix)
    return len(tokens) >= n and tokens[-n:] == suffix
