"""One constrained step's bitmask, filled in chunks as its requests' previous tokens are accepted.

Under async scheduling a constrained step's forward is launched before the previous step's tokens
are applied; the mask must follow those tokens. Filling it only after all of them are accepted puts
accept + fill end to end on the host's critical path (the device waits for the mask). Here each
request's row is queued as soon as its own token is accepted, and every `chunk` queued rows go to
the fill thread in one GIL-releasing xgrammar call, so the fill of the first rows overlaps the
accepts (and the rest of the update) of the later ones. It saves at most the accepts and update
time; the fill itself (xgrammar's, ~0.1 ms a row inside a length-bounded string) is unchanged.

The scheduler accepts a step's one-token results in one batch (`accept_tokens`), before the rest
of its update: those rows are all sent right after it, in one call, whatever the chunk size.

Rows are filled into a buffer slot per position in `structured_output_request_ids` and packed at
the end, because whether a row is needed (its grammar active, not terminated, no error) is known
only once its token has been accepted. A request accepted twice in one update (not expected on the
async path, which runs without drafts) waits for the rows in flight and is filled again at the end.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from tokenmill.core.outputs import GrammarOutput
from tokenmill.engine.structured_output.bitmask import restrict
from tokenmill.engine.structured_output.request_grammar import RequestGrammar


class StepFill:
    def __init__(
        self,
        request_ids: list[str],
        buffer: np.ndarray,
        pool: concurrent.futures.ThreadPoolExecutor,
        fill_rows: Callable[[list[RequestGrammar], np.ndarray, list[int]], None],
        chunk: int,
    ) -> None:
        self._slot = {request_id: slot for slot, request_id in enumerate(request_ids)}
        self._request_ids = request_ids
        self._buffer = buffer
        self._pool = pool
        self._fill_rows = fill_rows
        self._chunk = max(1, chunk)
        self._queued: list[tuple[int, RequestGrammar]] = []  # accepted, not yet sent to the thread
        self._sent: dict[int, RequestGrammar] = {}  # slot -> grammar, its row filled or filling
        self._futures: list[Future] = []

    def accepted(self, request_id: str, grammar: RequestGrammar) -> None:
        """The request's token was just accepted: queue its row (if this step has one and its
        next token is constrained)."""
        slot = self._slot.get(request_id)
        if slot is None:
            return
        if slot in self._sent:  # a second token: its filled row is stale
            self._wait_sent()
            del self._sent[slot]
        self._queued = [(s, g) for s, g in self._queued if s != slot]
        if grammar.needs_mask:
            self._queued.append((slot, grammar))
            if len(self._queued) >= self._chunk:
                self._send()

    def flush(self) -> None:
        """Send the queued rows now (a batch of accepts just ended: its rows go in one call)."""
        self._send()

    def finish(self, grammars: dict[str, RequestGrammar]) -> Future:
        """Every accept of the update is done: send the rows left (those of requests that got no
        token, e.g. a first decode after prefill), then pack the step's rows on the fill thread."""
        queued = {s for s, _ in self._queued}
        for slot, request_id in enumerate(self._request_ids):
            if slot in self._sent or slot in queued:
                continue
            grammar = grammars.get(request_id)
            if grammar is not None and grammar.needs_mask:
                self._queued.append((slot, grammar))
        self._send()
        return self._pool.submit(self._pack)

    def _send(self) -> None:
        if not self._queued:
            return
        slots = [s for s, _ in self._queued]
        grammars = [g for _, g in self._queued]
        self._sent.update(self._queued)
        self._queued = []
        self._futures.append(self._pool.submit(self._fill_rows, grammars, self._buffer, slots))
        # Give up the GIL for a moment: the fill thread takes it, starts xgrammar's call (which
        # releases it again) and fills beside us. Otherwise it waits for the engine loop's
        # pure-Python update to be forced off the GIL (every 5 ms, sys.getswitchinterval()).
        time.sleep(0)

    def _wait_sent(self) -> None:
        for future in self._futures:
            future.result()

    def _pack(self) -> GrammarOutput:
        """On the fill thread, after every chunk (the pool runs them in order)."""
        self._wait_sent()  # done already (one worker, in order); raises a chunk's error
        if not self._sent:
            return GrammarOutput()
        slots = sorted(self._sent)
        grammars = [self._sent[s] for s in slots]
        dense = slots[-1] == len(slots) - 1
        rows = self._buffer[: len(slots)] if dense else self._buffer[slots]
        restrict(rows, grammars)
        return GrammarOutput(
            request_ids=[self._request_ids[s] for s in slots],
            rows_per_request=[1] * len(slots),
            num_words=rows.shape[1],
            bitmask=rows.tobytes(),
        )
