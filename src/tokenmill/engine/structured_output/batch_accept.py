"""Advancing a step's requests' matchers by one token each, in one call from the scheduler.

The scheduler hands over a step's one-token results together (`StructuredOutputManager.
accept_tokens`), before it appends them and before the rest of its update, so the step's mask can
be filled from then on (step_fill.py). An active grammar's matcher takes its token; a grammar whose
start-after gate is closed checks the gate as `RequestGrammar.accept` would once the token is
appended; an errored one keeps its error.

The tokens go to the matchers one `accept_token` call each, not through xgrammar's
`BatchGrammarMatcher.batch_accept_token`: that is a C++ loop over the same accepts, and building its
argument arrays costs more than the Python calls it saves (64 rejected tokens: 73 us against 41 us
on the development CPU; 64 real accepts 0.27 against 0.20-0.22 ms, BENCHMARKS.md, issue 14). One
call per matcher also pins a failure on its request: xgrammar rejects a token by answering False
and raises only on a broken call or an internal error, which ends that request alone.
"""

from __future__ import annotations

import logging

from tokenmill.engine.structured_output.request_grammar import RequestGrammar

logger = logging.getLogger(__name__)


def accept_batch(items: list[tuple[RequestGrammar, list[int], int]]) -> list[str | None]:
    """items[i] = (grammar, the request's output tokens before this one, the token); per item the
    error message (the request ends with it) or None."""
    results: list[str | None] = []
    for grammar, output_token_ids, token_id in items:
        if grammar.error is not None:
            results.append(grammar.error)
        elif not grammar.active:
            grammar.gate_opens_with(output_token_ids, token_id)
            results.append(None)
        else:
            try:
                ok = grammar.matcher.accept_token(token_id)
            except Exception as exc:
                logger.exception("structured output: accepting a token failed")
                grammar.fail(
                    f"structured output: accepting token {token_id} failed: {type(exc).__name__}: {exc}"
                )
                results.append(grammar.error)
                continue
            results.append(grammar.accepted(ok, token_id))
    return results
