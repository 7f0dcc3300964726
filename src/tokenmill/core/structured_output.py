"""What the scheduler asks of structured output (constrained decoding), without knowing how.

The engine core owns an implementation (`engine/structured_output/`: xgrammar grammars compiled
off the step loop, one matcher per request); the scheduler only calls the methods below, so
`core/` stays free of torch and of any grammar library.

Life of a constrained request in the scheduler: `add_request` calls `start` (the compile is
queued) and parks the request in WAITING_FOR_GRAMMAR, which `schedule()` skips without blocking
the requests behind it; each `schedule()` polls the parked ones (`poll`): a ready grammar moves
its request to the waiting queue, a failed one ends it with the error. Every step that samples for
the request lists it in `SchedulerOutput.structured_output_request_ids`; each token it then
gets goes through `accept_token` (an error ends the request, a terminated grammar stops it); a
step's one-token results go through `accept_tokens` together, before the update appends them.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.core.request import Request

# A request's error message starts with this when its constraint itself is at fault (bad schema,
# regex or grammar, a compile over the time bound, no tokenizer): the API server answers 400.
INVALID_PREFIX = "invalid structured output: "


class StructuredOutputHooks(Protocol):
    def start(self, request: Request) -> None:
        """Begin compiling the request's grammar (cache hits are ready at once)."""

    def poll(self, request: Request) -> str | None | bool:
        """False while compiling; True when ready; an error message when it failed."""

    def accept_token(self, request: Request, token_id: int) -> str | None:
        """Advance the request's matcher by its newly appended output token (already in
        `request.output_token_ids`); an error message if the grammar rejects it."""

    def accept_tokens(self, batch: list[tuple[Request, int]]) -> list[str | None]:
        """`accept_token` for many requests at once (a step's results, one token each), called
        before each token is appended to `request.output_token_ids`: one error message or None
        per pair, in order."""
        ...

    def is_terminated(self, request: Request) -> bool:
        """The grammar is complete: the request stops here."""

    def allows_drafts(self, request: Request) -> bool:
        """Speculative decoding: whether the request's next tokens can be verified as drafts (its
        grammar is active: every draft position gets its mask row)."""
        ...

    def free(self, request_id: str) -> None:
        """The request ended: drop its matcher (and forget a pending compile)."""
