"""Filling one step's grammar bitmask on the host: one int32 row per constrained sampled token.

The rows are filled with xgrammar's batch API: one `batch_fill_next_token_bitmask` call a step (on
`TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS` C++ threads, without the GIL), and for draft rows one
batch fill call per draft depth, instead of a fill call per matcher and draft (the draft accepts
stay a call per matcher: batch_accept.py says why). `BitmaskFiller(batch=False)` keeps the per-matcher calls: the fallback
that finds which request a failed batch call belongs to, and the baseline of the A/B benchmark
(benchmarks/grammar_batch_microbench.py). A fill that fails ends that request with the error
(its row allows every token; the token it samples comes back to a grammar that answers the error).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from tokenmill import envs
from tokenmill.core.outputs import GrammarOutput
from tokenmill.engine.structured_output.request_grammar import RequestGrammar

logger = logging.getLogger(__name__)

# From this many constrained rows a step fills them in one call on xgrammar's thread pool: one call
# also gives up the GIL once, where row-by-row calls from the fill thread would each have to win it
# back from the busy engine loop.
BATCH_FILL_MIN_ROWS = 2


def fill_threads() -> int:
    """xgrammar threads for a step's fill: TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS, else half the
    CPUs this process may use, at most 8 (xgrammar's own "auto" halves the machine's hardware
    threads, which in a container can be many more than it is given)."""
    configured = envs.TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS.get()
    if configured is not None:
        if configured < 1:
            raise ValueError(f"{envs.TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS.name} must be at least 1")
        return configured
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    # At most 8: 64 rows gained little past 2-4 threads on the H100 host (BENCHMARKS.md, issue 14),
    # and xgrammar's source builds its thread pool anew at every batch call.
    return max(1, min(8, cpus // 2))


def apply_extra_masks(rows: np.ndarray, grammars: list[RequestGrammar]) -> None:
    """AND each row with its grammar's extra mask (JSON: no control characters), in place.
    `grammars[i]` is row i's."""
    masks = [grammar.extra_mask for grammar in grammars]
    first = masks[0] if masks else None
    if first is not None and all(mask is first for mask in masks):
        # One mask for every row (a step of JSON requests only): one in-place AND.
        np.bitwise_and(rows, first, out=rows)
        return
    # Row by row in place: a fancy-indexed `rows[row_ids] &= mask` gathers and scatters the rows
    # (0.06-0.56 ms for 32-64 rows of a 49K vocabulary on the development CPU, ~1 us a row here).
    for row, mask in enumerate(masks):
        if mask is not None:
            np.bitwise_and(rows[row], mask, out=rows[row])


def restrict(rows: np.ndarray, grammars: list[RequestGrammar]) -> None:
    """Apply each grammar's extra mask to its filled row; a row left with no allowed token is an error."""
    apply_extra_masks(rows, grammars)
    for row in np.flatnonzero(~rows.any(axis=1)):
        grammars[row].no_token_allowed()


class BitmaskFiller:
    """Keeps one preallocated [rows, words] int32 buffer (grown when a step needs more rows)."""

    def __init__(
        self, vocab_size: int, initial_rows: int = 16, threads: int | None = None, batch: bool = True
    ) -> None:
        self.num_words = -(-vocab_size // 32)
        self._buffer = np.zeros((initial_rows, self.num_words), dtype=np.int32)
        self._threads = threads  # None: fill_threads() at each batch call (the variable is live)
        self.batch = batch
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher (it holds the thread count)
        self._batch_threads = 0

    @property
    def threads(self) -> int:
        return self._threads if self._threads is not None else fill_threads()

    def buffer_for(self, rows: int) -> np.ndarray:
        """The buffer, grown to at least `rows` rows (its contents are not kept)."""
        if rows > len(self._buffer):
            self._buffer = np.zeros((max(rows, 2 * len(self._buffer)), self.num_words), np.int32)
        return self._buffer

    def _batch_matcher(self) -> Any:
        threads = self.threads
        if self._batch is None or threads != self._batch_threads:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
            self._batch_threads = threads
        return self._batch

    def fill_rows(
        self, grammars: list[RequestGrammar], buffer: np.ndarray, rows: list[int] | None = None
    ) -> None:
        """Fill `buffer[rows[i]]` (rows None: row i) from `grammars[i]`'s matcher, in one call that
        gives up the GIL when there are several (xgrammar fills them on its own threads: the
        matchers are independent). If that call fails, row by row: only the failing request errors."""
        if self.batch and len(grammars) >= BATCH_FILL_MIN_ROWS:
            try:
                self._batch_matcher().batch_fill_next_token_bitmask(
                    [g.matcher for g in grammars], buffer, rows
                )
                return
            except Exception:
                logger.exception(
                    "structured output: batch fill of %d rows failed; filling row by row", len(grammars)
                )
        for row, grammar in zip(range(len(grammars)) if rows is None else rows, grammars, strict=True):
            _fill_row(grammar, buffer, row)

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
        first_rows = [0] * len(counts)
        for i in range(1, len(counts)):
            first_rows[i] = first_rows[i - 1] + counts[i - 1]
        draft_lists = [drafts.get(request_id, []) for request_id, _ in grammars]
        only = [g for _, g in grammars]
        if self.batch:
            filled = _draft_rows_batch(self, only, draft_lists, counts, first_rows, buffer)
        else:
            filled = _draft_rows_loop(only, draft_lists, counts, first_rows, buffer)
        for first, count, n in zip(first_rows, counts, filled, strict=True):
            buffer[first + n + 1 : first + count] = buffer[first + n]
        rows = buffer[:total]
        apply_extra_masks(rows, [g for g, count in zip(only, counts, strict=True) for _ in range(count)])
        # Only a request's first row decides "nothing allowed"; an empty draft row repeats the one before.
        for grammar, first in zip(only, first_rows, strict=True):
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


def _fill_row(grammar: RequestGrammar, buffer: np.ndarray, row: int) -> None:
    try:
        grammar.matcher.fill_next_token_bitmask(buffer, row)
    except Exception as exc:
        logger.exception("structured output: filling a mask row failed")
        grammar.fail(f"structured output: filling the token mask failed: {type(exc).__name__}: {exc}")
        buffer[row] = -1  # any token: it comes back to `accept`, which answers the error


def _draft_rows_loop(
    grammars: list[RequestGrammar],
    drafts: list[list[int]],
    counts: list[int],
    firsts: list[int],
    buffer: np.ndarray,
) -> list[int]:
    """Per matcher: fill, accept a draft, fill, ..., roll back. Returns how many draft rows each
    request got filled after its first row (a stop token ends its rows: the matcher is terminated
    and xgrammar refuses to fill after it; nothing is sampled after a stop anyway)."""
    filled_counts = []
    for grammar, tokens, count, first in zip(grammars, drafts, counts, firsts, strict=True):
        matcher = grammar.matcher
        _fill_row(grammar, buffer, first)
        accepted = filled = 0
        if grammar.error is not None:  # its fill failed: the request ends, its drafts do not matter
            filled_counts.append(0)
            continue
        try:
            for token in tokens[: count - 1]:
                if not matcher.accept_token(token):
                    break
                accepted += 1
                if matcher.is_terminated():
                    break
                _fill_row(grammar, buffer, first + accepted)
                filled = accepted
        except Exception as exc:
            logger.exception("structured output: accepting a draft token failed")
            grammar.fail(f"structured output: checking draft tokens failed: {type(exc).__name__}: {exc}")
        if accepted:
            matcher.rollback(accepted)
        filled_counts.append(filled)
    return filled_counts


def _draft_rows_batch(
    filler: BitmaskFiller,
    grammars: list[RequestGrammar],
    drafts: list[list[int]],
    counts: list[int],
    firsts: list[int],
    buffer: np.ndarray,
) -> list[int]:
    """`_draft_rows_loop` by draft depth: one batch fill call for every request's first row, then
    per depth the accepts of the requests whose drafts so far all passed and one batch fill call
    for their rows; the rollbacks at the end. The same rows: each matcher sees the same calls in the
    same order. (The accepts and rollbacks are a call per matcher: batch_accept.py says why.)"""
    filler.fill_rows(grammars, buffer, firsts)
    accepted = [0] * len(grammars)
    filled = [0] * len(grammars)
    alive = [i for i, count in enumerate(counts) if count > 1 and grammars[i].error is None]
    depth = 0
    try:
        while alive:
            depth += 1
            still = []
            for i in alive:
                grammar = grammars[i]
                try:
                    if not grammar.matcher.accept_token(drafts[i][depth - 1]):
                        continue
                except Exception as exc:
                    logger.exception("structured output: accepting a draft token failed")
                    grammar.fail(
                        f"structured output: checking draft tokens failed: {type(exc).__name__}: {exc}"
                    )
                    continue
                accepted[i] += 1
                if not grammar.matcher.is_terminated():  # a stop token: nothing is filled after it
                    filled[i] = depth
                    still.append(i)
            filler.fill_rows([grammars[i] for i in still], buffer, [firsts[i] + depth for i in still])
            alive = [i for i in still if counts[i] > depth + 1]
    finally:
        for i, n in enumerate(accepted):
            if n:
                grammars[i].matcher.rollback(n)
    return filled
