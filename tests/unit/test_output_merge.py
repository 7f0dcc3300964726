"""engine/output_merge.py: a stream's waiting deltas merge per sequence, in order, never past the end."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engine.output_merge import merge_delta, take_waiting
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput


def delta(text: str, tokens: list[int], index: int = 0, finish: str | None = None, **kw) -> RequestOutput:
    logprobs = kw.pop("logprobs", None)
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        outputs=[CompletionOutput(index=index, text=text, token_ids=tokens, logprobs=logprobs,
                                  cumulative_logprob=kw.pop("cumulative", None), finish_reason=finish)],
        finished=finish is not None,
        **kw,
    )  # fmt: skip


def key(item):
    return (item.outputs[0].index, item.finished) if isinstance(item, RequestOutput) else None


def test_merge_joins_text_tokens_and_logprobs_and_takes_the_rest_from_the_later():
    lp = [{5: Logprob(-0.1, 1, "a")}]
    a = delta("ab", [5], logprobs=lp, cumulative=-0.1, metrics={"arrival_time": 1.0, "first_token_time": 2.0})
    b = delta("c", [6], finish="length", logprobs=[{6: Logprob(-0.2, 1, "c")}], cumulative=-0.3,
              num_cached_tokens=16, metrics={"arrival_time": 1.0, "last_token_time": 3.0})  # fmt: skip
    merged = merge_delta(a, b)
    out = merged.outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("abc", [5, 6], "length")
    assert out.logprobs == [lp[0], {6: Logprob(-0.2, 1, "c")}] and out.cumulative_logprob == -0.3
    assert merged.finished and merged.num_cached_tokens == 16
    assert merged.metrics == {"arrival_time": 1.0, "first_token_time": 2.0, "last_token_time": 3.0}
    assert (a.outputs[0].text, a.outputs[0].token_ids, a.finished) == ("ab", [5], False)  # inputs unchanged
    assert b.outputs[0].token_ids == [6]


def test_merge_refuses_other_sequences_and_anything_after_the_end():
    with pytest.raises(AssertionError):
        merge_delta(delta("a", [1], index=0), delta("b", [2], index=1))
    with pytest.raises(AssertionError):
        merge_delta(delta("a", [1], finish="stop"), delta("b", [2]))


def test_take_waiting_merges_each_sequence_in_order_up_to_an_item_that_never_merges():
    async def scenario() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        error = RuntimeError("engine gone")
        after_error = delta("z", [9])
        # Two choices' deltas interleaved, as n=2 steps deliver them, then an error.
        for item in (delta("x", [7], index=1), delta("b", [2]), delta("y", [8], index=1), delta("c", [3]),
                     error, after_error):  # fmt: skip
            queue.put_nowait(item)
        batch = take_waiting(queue, delta("a", [1]), key, merge_delta)
        assert [(o.outputs[0].index, o.outputs[0].text, o.outputs[0].token_ids) for o in batch[:2]] == [
            (0, "abc", [1, 2, 3]),
            (1, "xy", [7, 8]),
        ]
        assert batch[2] is error and len(batch) == 3  # after everything before it
        assert queue.qsize() == 1 and queue.get_nowait() is after_error  # left for the next take

    asyncio.run(scenario())


def test_take_waiting_never_merges_past_a_final_output():
    async def scenario() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        final = delta("b", [2], finish="stop")
        for item in (final, delta("n", [5], index=1, finish="length")):
            queue.put_nowait(item)
        batch = take_waiting(queue, delta("a", [1]), key, merge_delta)
        assert [(o.outputs[0].text, o.finished) for o in batch] == [("ab", True), ("n", True)]
        assert queue.empty()
        error = RuntimeError("x")
        assert take_waiting(queue, error, key, merge_delta) == [error]
        # A sequence's final output taken first stays alone: a later item of the same key (which the
        # engine never sends) would start a new one rather than merge into it.
        queue.put_nowait(delta("c", [3]))
        batch = take_waiting(queue, delta("z", [4], finish="stop"), key, merge_delta)
        assert [o.outputs[0].text for o in batch] == ["z", "c"]

    asyncio.run(scenario())
