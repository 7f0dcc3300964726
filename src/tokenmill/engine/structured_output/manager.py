"""The engine core's structured-output manager: the scheduler's hooks and the step's bitmask.

It implements `core.structured_output.StructuredOutputHooks` for the scheduler (compile on
`start`, readiness and the compile-time bound on `poll`, matcher updates on `accept_token`), and
`grammar_output(scheduler_output)`, which the engine core calls between the two phases of a step
with constrained requests: the device computes the forward while this fills the mask.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenmill import envs
from tokenmill.core.outputs import GrammarOutput, SchedulerOutput
from tokenmill.core.request import Request
from tokenmill.core.structured_output import INVALID_PREFIX
from tokenmill.engine.structured_output.backend import GrammarCompileError, XgrammarBackend
from tokenmill.engine.structured_output.batch_accept import accept_batch
from tokenmill.engine.structured_output.bitmask import BitmaskFiller, fill_threads
from tokenmill.engine.structured_output.request_grammar import RequestGrammar
from tokenmill.engine.structured_output.step_fill import StepFill
from tokenmill.stats_histogram import StatsHistogram


class _Compiling:
    __slots__ = ("future", "started", "cached")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.started = time.monotonic()
        self.cached = future.done()  # compiled for an earlier request: its compile time is not ours


# Seconds per step's bitmask fill: tens of microseconds a request; a GPU decode step is ~10 ms.
MASK_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)


# Constraints whose output is JSON: they also never produce a raw control character (json_safe.py).
JSON_KINDS = ("json", "json_object")


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._backend: XgrammarBackend | None = None  # built on the first constrained request
        self._filler: BitmaskFiller | None = None
        self._fill_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: dict[str, _Compiling] = {}
        self.grammars: dict[str, RequestGrammar] = {}
        # The launched constrained step whose rows fill as the previous step's tokens are accepted.
        self._step_fill: StepFill | None = None
        # Host time filling one step's bitmask.
        self.mask_seconds = StatsHistogram("structured_output_mask_seconds", MASK_BUCKETS)
        fill_threads()  # a bad TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS fails here, not in a step

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = XgrammarBackend(self._load_tokenizer, self.vocab_size)
        return self._backend

    def warm_up(self) -> Future:
        """Build the tokenizer and grammar compiler now, off the step loop (backend.prepare), rather
        than when the first constrained request arrives and makes every request of its wave wait."""
        return self.backend.prepare()

    # -- the scheduler's hooks --------------------------------------------------------------------

    def start(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        self._compiling[request.request_id] = _Compiling(self.backend.submit(params))

    def poll(self, request: Request) -> str | None | bool:
        compiling = self._compiling.get(request.request_id)
        if compiling is None:
            return request.request_id in self.grammars
        bound = envs.TOKENMILL_STRUCTURED_OUTPUT_COMPILE_TIMEOUT.get()
        future = compiling.future
        if not future.done():
            if time.monotonic() - compiling.started > bound:
                del self._compiling[request.request_id]
                return self._too_slow(request, bound)
            return False
        del self._compiling[request.request_id]
        try:
            compiled, seconds = future.result()
        except GrammarCompileError as exc:
            return str(exc)
        except Exception as exc:  # a bug, not the user's constraint
            return f"structured output: compiling the grammar failed: {type(exc).__name__}: {exc}"
        if seconds > bound and not compiling.cached:  # finished between two polls, but too late
            return self._too_slow(request, bound)
        try:
            params = request.sampling_params.structured_outputs
            json_kind = params is not None and params.kind in JSON_KINDS
            extra = self.backend.json_safe_words if json_kind else None
            self.grammars[request.request_id] = RequestGrammar(
                compiled, request, extra, vocab_size=self.backend.grammar_vocab_size
            )
        except Exception as exc:
            return f"{INVALID_PREFIX}cannot start the grammar matcher: {exc}"
        return True

    @staticmethod
    def _too_slow(request: Request, bound: float) -> str:
        params = request.sampling_params.structured_outputs
        kind = params.kind if params is not None else "grammar"
        return (
            f"{INVALID_PREFIX}compiling the {kind} constraint took longer than {bound:g} s "
            f"({envs.TOKENMILL_STRUCTURED_OUTPUT_COMPILE_TIMEOUT.name}); simplify it"
        )

    def accept_token(self, request: Request, token_id: int) -> str | None:
        grammar = self.grammars.get(request.request_id)
        if grammar is None:
            return "structured output: the request has no grammar state"
        error = grammar.accept(request.output_token_ids, token_id)
        if self._step_fill is not None:
            self._step_fill.accepted(request.request_id, grammar)
        return error

    def accept_tokens(self, batch: list[tuple[Request, int]]) -> list[str | None]:
        """`accept_token` for a step's one-token results, before they are appended and before the
        rest of the scheduler's update (batch_accept.py); a chunked fill sends their rows now."""
        grammars = [self.grammars.get(request.request_id) for request, _ in batch]
        items = [
            (grammar, request.output_token_ids, token_id)
            for grammar, (request, token_id) in zip(grammars, batch, strict=True)
            if grammar is not None  # answered by the loop below
        ]
        verdicts = iter(accept_batch(items))
        results: list[str | None] = []
        step_fill = self._step_fill
        for (request, _), grammar in zip(batch, grammars, strict=True):
            if grammar is None:
                results.append("structured output: the request has no grammar state")
                continue
            results.append(next(verdicts))
            if step_fill is not None:
                step_fill.accepted(request.request_id, grammar)
        if step_fill is not None:  # the rows fill while the scheduler finishes its update
            step_fill.flush()
        return results

    def is_terminated(self, request: Request) -> bool:
        grammar = self.grammars.get(request.request_id)
        return grammar is not None and grammar.is_terminated

    def allows_drafts(self, request: Request) -> bool:
        """Drafts can be masked: the grammar is on (a start-after marker inside the drafts would turn
        it on midway, past rows filled unconstrained) and not finished."""
        grammar = self.grammars.get(request.request_id)
        return grammar is not None and grammar.needs_mask

    def free(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)
        self.grammars.pop(request_id, None)

    # -- the engine core --------------------------------------------------------------------------

    def prepare_fill(self, scheduler_output: SchedulerOutput) -> None:
        """The constrained step just launched (async scheduling) is about to have the previous step's
        tokens applied: fill each of its rows as soon as its request's token is accepted
        (step_fill.py); `grammar_output_async` then sends the rest. Chunk 0: the whole fill waits
        for `grammar_output_async`, as without this."""
        self._step_fill = None
        chunk = envs.TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK.get() or 0
        if chunk <= 0 or scheduler_output.scheduled_spec_decode_tokens:
            return
        filler = self._bitmask_filler()
        request_ids = list(scheduler_output.structured_output_request_ids)
        self._step_fill = StepFill(
            request_ids, filler.buffer_for(len(request_ids)), self._pool(), filler.fill_rows, chunk
        )

    def _bitmask_filler(self) -> BitmaskFiller:
        if self._filler is None:
            self._filler = BitmaskFiller(self.backend.grammar_vocab_size)
        return self._filler

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # One worker: a step's chunks and its packing run in order.
        if self._fill_pool is None:
            self._fill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._fill_pool

    def grammar_output_async(self, scheduler_output: SchedulerOutput) -> Future:
        """`grammar_output` with the fill on the manager's thread: the engine core goes on (its
        outputs, the next schedule) while xgrammar fills the rows, and takes the result before its
        next launch. The matchers are not touched meanwhile (tokens are accepted only after that).
        Which rows need a mask is decided here, on the caller's thread: each matcher query is a
        call that gives up the GIL, and a thread that must win the GIL back from a busy engine
        loop after every one of 64 calls would take longer than the fill itself."""
        started = time.perf_counter()
        step_fill, self._step_fill = self._step_fill, None
        if step_fill is not None:
            packed = step_fill.finish(self.grammars)
            return self._pool().submit(self._observed, packed, started)
        rows = self._rows(scheduler_output)
        return self._pool().submit(self._fill, rows, started, scheduler_output.scheduled_spec_decode_tokens)

    def _observed(self, packed: Future, started: float) -> GrammarOutput:
        """Runs after `packed` on the one fill thread: the mask time counts from the last accept."""
        output = packed.result()
        self.mask_seconds.observe(time.perf_counter() - started)
        return output

    def grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The bitmask rows of the step's constrained requests whose next token is constrained."""
        self._step_fill = None
        return self._fill(
            self._rows(scheduler_output), time.perf_counter(), scheduler_output.scheduled_spec_decode_tokens
        )

    def _rows(self, scheduler_output: SchedulerOutput) -> list[tuple[str, RequestGrammar]]:
        grammars = self.grammars
        rows = []
        for request_id in scheduler_output.structured_output_request_ids:
            grammar = grammars.get(request_id)
            if grammar is not None and grammar.needs_mask:
                rows.append((request_id, grammar))
        return rows

    def _fill(
        self,
        rows: list[tuple[str, RequestGrammar]],
        started: float,
        drafts: dict[str, list[int]] | None = None,
    ) -> GrammarOutput:
        output = self._bitmask_filler().fill(rows, drafts)
        self.mask_seconds.observe(time.perf_counter() - started)
        return output

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes (an idle engine core waits
        here instead of spinning while the only requests left are compiling)."""
        futures = [c.future for c in self._compiling.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def get_stats(self) -> dict[str, float]:
        if self._backend is None:  # nothing constrained yet: nothing to report
            return {}
        return self._backend.compile_seconds.stats() | self.mask_seconds.stats()

    def shutdown(self) -> None:
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()
