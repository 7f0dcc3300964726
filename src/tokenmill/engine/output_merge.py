"""Streamed outputs that wait together leave together: one delta instead of several.

A stream's outputs queue up between the engine and its HTTP handler whenever the handler runs later
than the engine's steps arrive: the API server's event loop is busy (tens of thousands of chunks a
second at high concurrency), or the client reads slowly. Sent one by one, each costs the server a
chunk (JSON, an SSE event, a socket write) and the client a read, which is exactly the work that
made the server fall behind. Taken together they become one delta carrying all their tokens (what
vLLM's output collector does), so a server that falls behind sends fewer, larger chunks instead of
falling further behind; one that keeps up sends one chunk per step as before. The API server's
handlers take their outputs through serving_common.generate_all, which merges what waits there.

Only the deltas of one sequence merge, in order, and never past its final output; an item of any
other kind (an error, an end marker) stays behind everything that came before it, so nothing is
reordered within a sequence and nothing is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any

from tokenmill.outputs import CompletionOutput, RequestOutput


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One streamed (delta) output of a sequence standing for `earlier` followed by `later`: their
    text, tokens and logprobs joined, everything that describes the sequence so far (finish, error,
    cumulative logprob, cached tokens, metrics) from `later`. Neither input is changed."""
    a, b = earlier.outputs[0], later.outputs[0]
    assert a.index == b.index and earlier.request_id == later.request_id, "only one sequence's deltas merge"
    assert not earlier.finished, "nothing follows a sequence's final output"
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = [*(a.logprobs or ()), *(b.logprobs or ())]
    completion = CompletionOutput(
        index=b.index,
        text=a.text + b.text,
        token_ids=[*a.token_ids, *b.token_ids],
        cumulative_logprob=b.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
    )
    prompt_logprobs = later.prompt_logprobs if later.prompt_logprobs is not None else earlier.prompt_logprobs
    return RequestOutput(
        request_id=later.request_id,
        prompt=later.prompt,
        prompt_token_ids=later.prompt_token_ids,
        outputs=[completion],
        finished=later.finished,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=later.num_cached_tokens,
        error=later.error or earlier.error,
        metrics={**earlier.metrics, **later.metrics},
    )


def take_waiting(
    queue: asyncio.Queue,
    first: Any,
    key: Callable[[Any], tuple[Hashable, bool] | None],
    merge: Callable[[Any, Any], Any],
) -> list[Any]:
    """`first` (just taken from `queue`) and the items waiting behind it, without waiting for more,
    with each sequence's deltas merged into one: the items to hand out, in order.

    `key(item)` is (its sequence, whether it is the sequence's final output), or None for an item
    that never merges (an error, an end marker); `merge(a, b)` joins two items of one sequence. The
    sequences keep the order of their first waiting item (the deltas of n choices arrive
    interleaved; each choice's own order is kept). An item that never merges ends the batch, after
    everything that came before it; whatever came after it stays in the queue.
    """
    batch: list[Any] = []
    open_at: dict[Hashable, int] = {}  # sequence -> its unfinished item's place in the batch
    item: Any = first
    while True:
        item_key = key(item)
        if item_key is None:
            batch.append(item)
            return batch
        sequence, final = item_key
        at = open_at.get(sequence)
        if at is None:
            at = len(batch)
            batch.append(item)
        else:
            batch[at] = merge(batch[at], item)
        if final:
            open_at.pop(sequence, None)
        else:
            open_at[sequence] = at
        if queue.empty():
            return batch
        item = queue.get_nowait()
