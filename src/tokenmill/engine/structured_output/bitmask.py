"""Filling one step's grammar bitmask on the host: one int32 row per constrained sampled token."""

from __future__ import annotations

import numpy as np

from tokenmill.core.outputs import GrammarOutput
from tokenmill.engine.structured_output.request_grammar import RequestGrammar


class BitmaskFiller:
    """Keeps one preallocated [rows, words] int32 buffer (grown when a step needs more rows)."""

    def __init__(self, vocab_size: int, initial_rows: int = 16) -> None:
        self.num_words = -(-vocab_size // 32)
        self._buffer = np.zeros((initial_rows, self.num_words), dtype=np.int32)

    def fill(self, grammars: list[tuple[str, RequestGrammar]]) -> GrammarOutput:
        """Rows for the requests whose next token is constrained, in the given (batch) order."""
        if len(grammars) > len(self._buffer):
            self._buffer = np.zeros((max(len(grammars), 2 * len(self._buffer)), self.num_words), np.int32)
        buffer = self._buffer
        request_ids: list[str] = []
        for row, (request_id, grammar) in enumerate(grammars):
            grammar.fill(buffer, row)
            request_ids.append(request_id)
        if not request_ids:
            return GrammarOutput()
        return GrammarOutput(
            request_ids=request_ids,
            rows_per_request=[1] * len(request_ids),
            num_words=self.num_words,
            bitmask=buffer[: len(request_ids)].tobytes(),
        )
