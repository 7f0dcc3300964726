"""Pieces shared by the chat and completions handlers: fan-out over prompts and n, accumulation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import ErrorResponse, PromptTokensDetails, UsageInfo
from tokenmill.server.state import ServerState

logger = logging.getLogger("tokenmill.server")
T = TypeVar("T")


@dataclass(slots=True)
class PreparedPrompt:
    text: str | None
    token_ids: list[int]


@dataclass(slots=True)
class ChoiceState:
    """Everything one choice (prompt i, sample j) has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sent_first: bool = False


# Tokenizing more text than this moves to a worker thread, so one huge prompt does not stall every
# stream on the event loop (the Rust tokenizer releases the GIL while it works).
TOKENIZE_IN_THREAD_CHARS = 32_768


async def tokenize_off_loop(num_chars: int, fn: Callable[..., T], *args: Any) -> T:
    if num_chars > TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


@dataclass(slots=True)
class RunStatus:
    """Set by generate_all while it runs; read by the handlers when it ends."""

    timed_out: bool = False
    timeout_s: float | None = None


def validate_prompts(
    state: ServerState,
    prompts: list[PreparedPrompt],
    params: SamplingParams,
    priority: int,
    cache_salt: str | None,
) -> None:
    """Runs every check the engine client would, so a bad prompt fails before any is admitted."""
    if params.n > state.max_n:
        raise InvalidRequestError(f"n must be at most {state.max_n}, got {params.n}", param="n")
    processor = state.engine.input_processor
    assert processor is not None
    for prompt in prompts:
        processor.make_request("validate", prompt.token_ids, params, priority=priority, cache_salt=cache_salt)


def request_timeout(state: ServerState, requested: float | None) -> float | None:
    """The per-request timeout, never longer than the server's --request-timeout."""
    limits = [t for t in (requested, state.request_timeout) if t is not None]
    return min(limits) if limits else None


async def generate_all(
    state: ServerState,
    request_id: str,
    prompts: list[PreparedPrompt],
    params: SamplingParams,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    status: RunStatus | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs every prompt concurrently; yields (prompt index, delta output) as they arrive.

    Leaving the iteration early (client gone, error) cancels every prompt's generation, which
    aborts its sequences in the engine. When `status.timeout_s` passes first, the unfinished
    sequences are aborted and end with finish_reason "abort"; `status.timed_out` tells.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    engine_ids = [f"{request_id}-p{i}" for i in range(len(prompts))]

    async def pump(i: int, prompt: PreparedPrompt) -> None:
        try:
            async for out in state.engine.generate(
                engine_ids[i],
                prompt.text,
                prompt.token_ids,
                params,
                stream=True,
                priority=priority,
                cache_salt=cache_salt,
            ):
                queue.put_nowait((i, out))
            queue.put_nowait(done)
        except Exception as exc:
            queue.put_nowait(exc)

    async def expire(timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        assert status is not None
        status.timed_out = True
        for engine_id in engine_ids:
            await state.engine.abort(engine_id)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    timer = None
    if status is not None and status.timeout_s is not None:
        timer = asyncio.create_task(expire(status.timeout_s))
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in [*tasks, timer]:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*tasks, *([timer] if timer else []), return_exceptions=True)


def make_usage(prompts: list[PreparedPrompt], choices: list[ChoiceState], cached_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def error_event(message: str, status_code: int = 500, error_type: str = "internal_error") -> str:
    body = ErrorResponse.build(message, type=error_type, status_code=status_code)
    return f"data: {body.model_dump_json()}\n\n"


def timeout_event(status: RunStatus) -> str:
    return error_event(
        f"the request ran longer than its timeout of {status.timeout_s:g} s and was aborted",
        status_code=408,
        error_type="timeout_error",
    )


def stream_failure_event(exc: BaseException) -> str:
    """The error event that ends a stream whose generation raised."""
    if isinstance(exc, TokenmillError):
        return error_event(exc.message, exc.status_code, exc.error_type)
    logger.error("streaming a response failed", exc_info=exc)
    return error_event(f"internal error: {type(exc).__name__}: {exc}")


async def wait_for_disconnect(receive) -> None:
    """Returns once the client has gone away (the body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
