"""Advancing many requests' matchers by one token each in one xgrammar call.

The scheduler hands over a step's one-token results together (`StructuredOutputManager.
accept_tokens`), before it appends them: the active grammars go to `batch_accept_token` (a C++ loop,
no Python call per matcher), a grammar whose start-after gate is closed checks the gate as
`RequestGrammar.accept` would once the token is appended, and an errored one keeps its error.

xgrammar rejects a token by answering False; it raises only on a broken call or an internal error,
after which it is unknown which matchers of the batch moved: every request of that batch ends with
the error, and the engine goes on.
"""

from __future__ import annotations

import logging

from tokenmill.engine.structured_output.request_grammar import RequestGrammar

logger = logging.getLogger(__name__)


def accept_batch(items: list[tuple[RequestGrammar, list[int], int]]) -> list[str | None]:
    """items[i] = (grammar, the request's output tokens before this one, the token); per item the
    error message (the request ends with it) or None."""
    results: list[str | None] = [None] * len(items)
    batch: list[int] = []
    for i, (grammar, output_token_ids, token_id) in enumerate(items):
        if grammar.error is not None:
            results[i] = grammar.error
        elif not grammar.active:
            grammar.gate_opens_with(output_token_ids, token_id)
        else:
            batch.append(i)
    if not batch:
        return results
    matchers = [items[i][0].matcher for i in batch]
    tokens = [items[i][2] for i in batch]
    try:
        verdicts = _batch_accept_token(matchers, tokens)
    except Exception as exc:
        logger.exception("structured output: batch accept of %d tokens failed", len(batch))
        message = f"structured output: accepting the step's tokens failed: {type(exc).__name__}: {exc}"
        for i in batch:
            items[i][0].fail(message)
            results[i] = items[i][0].error
        return results
    for i, ok in zip(batch, verdicts, strict=True):
        results[i] = items[i][0].accepted(bool(ok), items[i][2])
    return results


def _batch_accept_token(matchers: list, tokens: list[int]) -> list[bool]:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
