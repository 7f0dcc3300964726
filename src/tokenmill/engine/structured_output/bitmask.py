"""Filling one step's grammar bitmask on the host: one int32 row per constrained sampled token."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.core.outputs import GrammarOutput
from tokenmill.engine.structured_output.request_grammar import RequestGrammar

# From this many constrained rows a step fills them in one call on xgrammar's thread pool: one call
# also gives up the GIL once, where row-by-row calls from the fill thread would each have to win it
# back from the busy engine loop.
BATCH_FILL_MIN_ROWS = 2


def apply_extra_masks(rows: np.ndarray, grammars: list[RequestGrammar]) -> None:
    """AND each row with its grammar's extra mask (JSON: no control characters), grouped by mask
    (one vectorised AND for all JSON rows). `grammars[i]` is row i's."""
    by_mask: dict[int, tuple[np.ndarray, list[int]]] = {}
    for row, grammar in enumerate(grammars):
        if grammar.extra_mask is not None:
            by_mask.setdefault(id(grammar.extra_mask), (grammar.extra_mask, []))[1].append(row)
    for mask, row_ids in by_mask.values():
        rows[row_ids] &= mask


def restrict(rows: np.ndarray, grammars: list[RequestGrammar]) -> None:
    """Apply each grammar's extra mask to its filled row; a row left with no allowed token is an error."""
    apply_extra_masks(rows, grammars)
    for row in np.flatnonzero(~rows.any(axis=1)):
        grammars[row].no_token_allowed()


class BitmaskFiller:
    """Keeps one preallocated [rows, words] int32 buffer (grown when a step needs more rows)."""

    def __init__(self, vocab_size: int, initial_rows: int = 16) -> None:
        self.num_words = -(-vocab_size // 32)
        self._buffer = np.zeros((initial_rows, self.num_words), dtype=np.int32)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, for large steps

    def buffer_for(self, rows: int) -> np.ndarray:
        """The buffer, grown to at least `rows` rows (its contents are not kept)."""
        if rows > len(self._buffer):
            self._buffer = np.zeros((max(rows, 2 * len(self._buffer)), self.num_words), np.int32)
        return self._buffer

    def fill_rows(self, grammars: list[RequestGrammar], buffer: np.ndarray, rows: list[int] | None = None) -> None:
        """Fill `buffer[rows[i]]` (rows None: row i) from `grammars[i]`'s matcher, in one call that
        gives up the GIL when there are several (xgrammar fills them on its own threads: the
        matchers are independent)."""
        if len(grammars) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            matchers = [g.matcher for g in grammars]
            if rows is None:
                self._batch.batch_fill_next_token_bitmask(matchers, buffer)
            else:
                self._batch.batch_fill_next_token_bitmask(matchers, buffer, rows)
        else:
            for row, grammar in zip(range(len(grammars)) if rows is None else rows, grammars, strict=True):
                grammar.matcher.fill_next_token_bitmask(buffer, row)

    def fill(
        self, grammars: list[tuple[str, RequestGrammar]], drafts: dict[str, list[int]] | None = None
    ) -> GrammarOutput:
        """Rows for the requests whose next token is constrained, in the given (batch) order; a
        request verifying draft tokens (`drafts`) gets a row per draft position too."""
        if drafts and any(request_id in drafts for request_id, _ in grammars):
            return self._fill_with_drafts(grammars, drafts)
        buffer = self.buffer_for(len(grammars))
        request_ids = [request_id for request_id, _ in grammars]
        if not request_ids:
            return GrammarOutput()
        self.fill_rows([g for _, g in grammars], buffer)
        restrict(buffer[: len(grammars)], [g for _, g in grammars])
        return GrammarOutput(
            request_ids=request_ids,
            rows_per_request=[1] * len(request_ids),
            num_words=self.num_words,
            bitmask=buffer[: len(request_ids)].tobytes(),
        )

    def _fill_with_drafts(
        self, grammars: list[tuple[str, RequestGrammar]], drafts: dict[str, list[int]]
    ) -> GrammarOutput:
        """Per request, the row of its next token, then, for each draft, the row after the drafts
        before it: the matcher accepts them tentatively and rolls back. A draft the grammar refuses
        will be rejected by the verification (its masked probability is 0), so the rows after it
        are never read: they repeat the last filled row (an all-zero row would read as "nothing
        allowed")."""
        counts = [1 + len(drafts.get(request_id, ())) for request_id, _ in grammars]
        total = sum(counts)
        buffer = self.buffer_for(total)
        row = 0
        first_rows: list[int] = []
        for (request_id, grammar), count in zip(grammars, counts, strict=True):
            matcher = grammar.matcher
            first = row
            first_rows.append(first)
            matcher.fill_next_token_bitmask(buffer, first)
            accepted = 0
            for token in drafts.get(request_id, ())[: count - 1]:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                accepted += 1
                matcher.fill_next_token_bitmask(buffer, first + accepted)
            buffer[first + accepted + 1 : first + count] = buffer[first + accepted]
            if accepted:
                matcher.rollback(accepted)
            row = first + count
        rows = buffer[:total]
        apply_extra_masks(rows, [g for (_, g), count in zip(grammars, counts, strict=True) for _ in range(count)])
        # Only a request's first row decides "nothing allowed"; an empty draft row repeats the one before.
        for (_, grammar), first in zip(grammars, first_rows, strict=True):
            if not rows[first].any():
                grammar.no_token_allowed()
        firsts = set(first_rows)
        for r in np.flatnonzero(~rows.any(axis=1)):
            if int(r) not in firsts:
                rows[r] = rows[r - 1]
        return GrammarOutput(
            request_ids=[request_id for request_id, _ in grammars],
            rows_per_request=counts,
            num_words=self.num_words,
            bitmask=rows.tobytes(),
        )
