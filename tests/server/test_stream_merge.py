"""A stream whose handler runs later than its outputs arrive sends the outputs that waited as one
chunk per choice (serving_common.generate_all, engine/output_merge.py), with every token, logprob
and the text in order, and the final output's finish reason."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.server.fake_engine import MODEL, FakeEngine, wait_until
from tests.server.test_api_inprocess import run
from tokenmill.engine.messages import StepOutputs
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.state import ServerState


def _steps(engine: FakeEngine, count: int) -> None:
    """`count` engine steps delivered back to back, as a busy event loop reads several engine
    messages before any stream's handler runs."""
    for _ in range(count):
        engine.core._deliver(StepOutputs(outputs=engine.core.step(), stats=engine.core.stats()))


def _chunk(event: str) -> dict:
    return json.loads(event.removeprefix("data: "))


def test_waiting_completion_deltas_leave_as_one_chunk():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True  # the test steps the engine itself
        reply = engine.core.reply_ids
        body = CompletionRequest.model_validate(
            {"model": MODEL, "prompt": "x", "max_tokens": 12, "ignore_eos": True, "stream": True,
             "logprobs": 0, "stream_options": {"include_usage": True}}
        )  # fmt: skip
        events = await create_completion(state, body)
        first = asyncio.ensure_future(events.__anext__())  # the handler starts: its request goes out
        await wait_until(lambda: len(engine.core.running) == 1)
        _steps(engine, 5)  # five tokens arrive before the handler runs
        chunk = _chunk(await first)["choices"][0]
        assert chunk["text"] == engine.tokenizer.decode(reply[:5])
        assert len(chunk["logprobs"]["tokens"]) == 5 and len(chunk["logprobs"]["text_offset"]) == 5
        # Three steps, each moved on to the handler's queue before the next (the handler is the
        # slow one now), then read together.
        for _ in range(3):
            _steps(engine, 1)
            await asyncio.sleep(0.01)
        chunk = _chunk(await events.__anext__())["choices"][0]
        assert chunk["text"] == engine.tokenizer.decode(reply[5:8])
        assert chunk["logprobs"]["text_offset"][0] == len(engine.tokenizer.decode(reply[:5]))
        _steps(engine, 4)  # the rest, the final output among them
        chunk = _chunk(await events.__anext__())["choices"][0]
        assert chunk["text"] == engine.tokenizer.decode(reply[8:12]) and chunk["finish_reason"] == "length"
        rest = [e async for e in events]
        assert _chunk(rest[0])["usage"]["completion_tokens"] == 12 and rest[-1] == "data: [DONE]\n\n"
        assert engine.num_unfinished == 0 and not engine.output_processor.states

    run(scenario)


def test_waiting_deltas_of_n_choices_merge_per_choice():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.paused = True
        reply = engine.core.reply_ids
        body = ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
             "ignore_eos": True, "stream": True, "n": 2}
        )  # fmt: skip
        events = await create_chat_completion(state, body)
        roles = [_chunk(await events.__anext__()) for _ in range(2)]  # sent before any output
        assert [c["choices"][0]["delta"]["role"] for c in roles] == ["assistant", "assistant"]
        first = asyncio.ensure_future(events.__anext__())
        await wait_until(lambda: len(engine.core.running) == 2)
        _steps(engine, 6)  # both choices' whole replies wait, interleaved step by step
        chunks = [_chunk(await first)] + [_chunk(e) async for e in events if e != "data: [DONE]\n\n"]
        texts: dict[int, list[str]] = {0: [], 1: []}
        for chunk in chunks:
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    texts[choice["index"]].append(choice["delta"]["content"])
        expected = engine.tokenizer.decode(reply[:6])
        assert {i: "".join(t) for i, t in texts.items()} == {0: expected, 1: expected}
        assert all(len(t) < 6 for t in texts.values()), texts  # fewer chunks than tokens
        assert engine.num_unfinished == 0

    run(scenario)
