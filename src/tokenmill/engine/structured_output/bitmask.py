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


def restrict(rows: np.ndarray, grammars: list[RequestGrammar]) -> None:
    """Apply each grammar's extra mask (JSON: no control characters) to its filled row, grouped by
    mask (one vectorised AND for all JSON rows); a row left with no allowed token is an error."""
    by_mask: dict[int, tuple[np.ndarray, list[int]]] = {}
    for row, grammar in enumerate(grammars):
        if grammar.extra_mask is not None:
            by_mask.setdefault(id(grammar.extra_mask), (grammar.extra_mask, []))[1].append(row)
    for mask, row_ids in by_mask.values():
        rows[row_ids] &= mask
    for row in np.flatnonzero(~rows.any(axis=1)):
        grammars[row].no_token_allowed()


class BitmaskFiller:
    """Keeps one preallocated [rows, words] int32 buffer (grown when a step needs more rows)."""

    def __init__(self, vocab_size: int, initial_rows: int = 16) -> None:
        self.num_words = -(-vocab_size // 32)
        self._buffer = np.zeros((initial_rows, self.num_words), dtype=np.int32)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, for large steps

    def fill(self, grammars: list[tuple[str, RequestGrammar]]) -> GrammarOutput:
        """Rows for the requests whose next token is constrained, in the given (batch) order."""
        if len(grammars) > len(self._buffer):
            self._buffer = np.zeros((max(len(grammars), 2 * len(self._buffer)), self.num_words), np.int32)
        buffer = self._buffer
        request_ids = [request_id for request_id, _ in grammars]
        if not request_ids:
            return GrammarOutput()
        if len(grammars) >= BATCH_FILL_MIN_ROWS:
            # xgrammar fills the rows on its own threads (the matchers are independent).
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([g.matcher for _, g in grammars], buffer)
        else:
            for row, (_, grammar) in enumerate(grammars):
                grammar.matcher.fill_next_token_bitmask(buffer, row)
        restrict(buffer[: len(grammars)], [g for _, g in grammars])
        return GrammarOutput(
            request_ids=request_ids,
            rows_per_request=[1] * len(request_ids),
            num_words=self.num_words,
            bitmask=buffer[: len(request_ids)].tobytes(),
        )
