"""Pieces shared by the chat and completions handlers: fan-out over prompts and n, accumulation."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.engine.otel_spans import TraceContext
from tokenmill.engine.output_merge import merge_delta, take_waiting
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import AdmissionTicket, QueueTimeoutError, shed_error
from tokenmill.server.lora_registry import LoRAHold
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
    retry_after: float | None = None  # finish_reason "shed": the engine's estimate
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
    """One request's deadlines and admission, set up by the handler; generate_all records what
    happened (which deadline ended which sequence) for the handler to report."""

    ticket: AdmissionTicket
    timeout_s: float | None = None  # the whole request (--request-timeout / request_timeout)
    queue_timeout_s: float | None = None  # until each sequence's first token (--max-queue-time)
    timed_out: bool = False
    # (prompt index, sample index) of the sequences the queue-time limit aborted before they started.
    queue_expired: set[tuple[int, int]] = field(default_factory=set)
    # The request field its output constraint came from: the engine's compile errors name it.
    constraint_param: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    lora_hold: LoRAHold | None = None  # keeps the adapter from being unloaded until the request ends
    trace: TraceContext | None = None  # the HTTP request's trace context (--otlp-traces-endpoint)
    # When its HTTP request reached the route (time.monotonic()): the engine requests' arrival_time,
    # so TTFT and the slo policy's deadlines count parsing and tokenizing (None: when they are sent).
    arrival: float | None = None

    def release(self) -> None:
        self.ticket.release()
        if self.lora_hold is not None:
            self.lora_hold.release()

    def never_started(self, choices: list[ChoiceState]) -> bool:
        """True when the queue-time limit ended every sequence before any produced a token."""
        return len(self.queue_expired) == len(choices) and not any(c.token_ids for c in choices)


def admit(
    state: ServerState,
    prompts: list[PreparedPrompt],
    params: SamplingParams,
    requested_timeout: float | None,
    constraint_param: str | None = None,
    lora: LoRARequest | None = None,
) -> RunStatus:
    """Admission control (429 when too much is waiting), the hold on its LoRA adapter (404 if it
    was unloaded meanwhile), then the request's deadlines. RunStatus.release() gives both back."""
    ticket = state.admission.admit([len(p.token_ids) for p in prompts], params.n)
    hold = None
    if lora is not None:
        assert state.lora is not None  # resolve_model found the adapter there
        try:
            hold = state.lora.hold(lora)
        except TokenmillError:
            ticket.release()
            raise
    for prompt in prompts:
        max_tokens = params.max_tokens if params.max_tokens is not None else state.max_model_len - len(prompt.token_ids)
        state.metrics.on_request_params(params.n, max_tokens)
    return RunStatus(
        ticket=ticket,
        timeout_s=request_timeout(state, requested_timeout),
        queue_timeout_s=state.max_queue_time,
        constraint_param=constraint_param,
        lora=lora,
        lora_hold=hold,
    )


def stream_waits_for_first_output(state: ServerState, params: SamplingParams) -> bool:
    """Whether a stream's response starts only with its first output: with an output constraint
    (it may not compile: 400), and under the slo policy (a request may be shed: 429)."""
    return params.structured_outputs is not None or state.scheduling_policy == "slo"


async def check_first_output(
    outputs: AsyncIterator[tuple[int, RequestOutput]], status: RunStatus
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """For a stream: waits for the first output before the response starts, so that a constraint
    the engine cannot compile is a 400 like any other bad field, and a request the slo scheduler
    shed before it started a 429 with Retry-After, not an error event inside a 200 stream.
    Returns the outputs, the first one included."""
    try:
        first = await outputs.__anext__()
    except StopAsyncIteration:
        return outputs
    _, out = first
    if out.finished and out.outputs[0].finish_reason == "shed":
        await outputs.aclose()  # type: ignore[attr-defined]  # aborts its other sequences
        raise shed_error(out.error, out.metrics.get("retry_after"))
    if out.finished and out.outputs[0].finish_reason == "error":
        error = sequence_error(out.outputs[0].index, out.error, status.constraint_param)
        if isinstance(error, InvalidRequestError):
            await outputs.aclose()  # type: ignore[attr-defined]
            raise error

    async def chained() -> AsyncGenerator[tuple[int, RequestOutput], None]:
        try:
            yield first
            async for item in outputs:
                yield item
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]

    return chained()


class EventStream:
    """The SSE events of one streaming response. Closing it closes the events and releases the
    request's admission, even when the response never started iterating (client gone first)."""

    def __init__(self, events: AsyncGenerator[str, None], status: RunStatus) -> None:
        self._events = events
        self._status = status

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._status.release()


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
    status: RunStatus,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs every prompt concurrently; yields (prompt index, delta output) as they arrive.

    Leaving the iteration early (client gone, error) cancels every prompt's generation, which
    aborts its sequences in the engine. When `status.timeout_s` passes first, the unfinished
    sequences are aborted and end with finish_reason "abort"; `status.timed_out` tells. When
    `status.queue_timeout_s` passes, the sequences that have not produced a token yet end the
    same way; `status.queue_expired` tells which. Ending releases the request's admission and
    its hold on its LoRA adapter.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    engine_ids = [f"{request_id}-p{i}" for i in range(len(prompts))]
    ticket = status.ticket

    async def prompt_outputs(i: int, prompt: PreparedPrompt) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        generated = [0] * params.n  # tokens per sequence: vLLM's request_max_num_generation_tokens
        outputs = state.engine.generate(
            engine_ids[i],
            prompt.text,
            prompt.token_ids,
            params,
            stream=True,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=status.lora,
            trace=status.trace,
            arrival_time=status.arrival,
        )
        try:
            async for out in outputs:
                if out.outputs[0].token_ids or out.finished:  # no longer waiting to start
                    ticket.started(i, out.outputs[0].index)
                    generated[out.outputs[0].index] += len(out.outputs[0].token_ids)
                yield i, out
        finally:
            # Now, not when the collector finds it: closing the engine's stream aborts what is left.
            await outputs.aclose()  # type: ignore[attr-defined]
        state.metrics.on_request_max_generation_tokens(max(generated))

    async def pump(i: int, prompt: PreparedPrompt) -> None:
        try:
            async for item in prompt_outputs(i, prompt):
                queue.put_nowait(item)
            queue.put_nowait(done)
        except Exception as exc:
            queue.put_nowait(exc)

    async def expire(timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        status.timed_out = True
        for engine_id in engine_ids:
            await state.engine.abort(engine_id)

    async def expire_waiting(timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        unstarted: dict[int, list[int]] = defaultdict(list)
        for i, j in list(ticket.waiting):
            status.queue_expired.add((i, j))
            unstarted[i].append(j)
        for i, sample_indexes in unstarted.items():
            await state.engine.abort(engine_ids[i], sample_indexes)

    timers = []
    if status.timeout_s is not None:
        timers.append(asyncio.create_task(expire(status.timeout_s)))
    if status.queue_timeout_s is not None:
        timers.append(asyncio.create_task(expire_waiting(status.queue_timeout_s)))
    if len(prompts) == 1:
        # One prompt (the usual request): its outputs straight from the engine's stream, which
        # merges deltas that waited, without a task and a queue between: ~5 us less a token
        # (benchmarks/BENCHMARKS.md, the API server's CPU per streamed token).
        single = prompt_outputs(0, prompts[0])
        try:
            async for item in single:
                yield item
        finally:
            await single.aclose()
            status.release()
            for timer in timers:
                timer.cancel()
            await asyncio.gather(*timers, return_exceptions=True)
        return
    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    remaining = len(tasks)
    ready: deque = deque()  # taken from the queue, to hand out

    def sequence_key(item: Any) -> tuple[tuple[int, int], bool] | None:
        if isinstance(item, tuple):
            i, out = item
            return (i, out.outputs[0].index), out.finished
        return None

    def merge(a: tuple[int, RequestOutput], b: tuple[int, RequestOutput]) -> tuple[int, RequestOutput]:
        return a[0], merge_delta(a[1], b[1])

    try:
        while remaining:
            if not ready:
                # A sequence's deltas that waited here together (the handler ran later than they
                # came) go out as one chunk: engine/output_merge.py.
                ready.extend(take_waiting(queue, await queue.get(), sequence_key, merge))
            item = ready.popleft()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        status.release()
        for task in [*tasks, *timers]:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, *timers, return_exceptions=True)


def token_namer(state: ServerState, as_token_ids: bool) -> Callable[[int, str | None], str]:
    """How logprobs name a token: its text, or "token_id:N" (return_tokens_as_token_ids, for
    clients that cannot take tokens that are partial UTF-8)."""
    if as_token_ids:
        return lambda token_id, _decoded: f"token_id:{token_id}"
    decode = state.engine.output_processor.decode_token  # type: ignore[union-attr]
    return lambda token_id, decoded: decoded if decoded is not None else decode(token_id)


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


def queue_timeout_event(status: RunStatus) -> str:
    return error_event(queue_timeout_message(status), status_code=503, error_type="service_unavailable")


def queue_timeout_message(status: RunStatus) -> str:
    return (
        f"the request waited longer than the queue-time limit of {status.queue_timeout_s:g} s without "
        "starting and was aborted; the server is overloaded, retry later"
    )


def raise_if_never_started(status: RunStatus, choices: list[ChoiceState]) -> None:
    """Non-streaming: a request the queue-time limit ended before any token is a 503, not a 200."""
    if status.never_started(choices):
        raise QueueTimeoutError(queue_timeout_message(status))


def finish_event(status: RunStatus, prompt_index: int, choice_index: int, out: RequestOutput) -> str | None:
    """The error event that goes before a sequence's last chunk when it did not end normally."""
    completion = out.outputs[0]
    if completion.finish_reason == "error":
        return exception_event(sequence_error(choice_index, out.error, status.constraint_param))
    if completion.finish_reason == "shed":
        return exception_event(shed_error(out.error, out.metrics.get("retry_after")))
    if completion.finish_reason == "abort":
        if (prompt_index, completion.index) in status.queue_expired:
            return queue_timeout_event(status)
        if status.timed_out:
            return timeout_event(status)
    return None


class GenerationError(TokenmillError):
    """A sequence the model failed on (non-finite logits, a failed step, its output not decodable):
    nothing the client could have changed, so a 500 that names what failed."""

    status_code = 500
    error_type = "internal_error"


# Errors the engine ends a sequence with that are about the request itself: it can never run on this
# server, whatever the load (core/scheduler.py). The server refuses such requests before admitting
# them; these arrive only if the engine's check and the server's disagree, and must then say that
# retrying cannot help (OpenAI's clients retry a 500, not a 400). Marker in the message -> the field.
REQUEST_ERROR_MARKERS = (
    ("more than max_model_len", "prompt"),  # the prompt alone is longer than the context
    ("but the whole pool has", "max_tokens"),  # more KV blocks than the whole pool
)
# The engine's error for a constraint it cannot compile (engine/structured_output): a 400 naming
# the field the constraint came from.
CONSTRAINT_ERROR_PREFIX = "invalid structured output: "


def sequence_error(choice_index: int, reason: str | None, constraint_param: str | None = None) -> TokenmillError:
    """What one choice that ended with finish_reason "error" tells its client: the same status,
    type, param and message in a stream's error event and as a non-streaming response."""
    if reason and reason.startswith(CONSTRAINT_ERROR_PREFIX):
        return InvalidRequestError(reason, param=constraint_param or "structured_outputs")
    message = f"choice {choice_index} failed: {reason or 'unknown error'}"
    for marker, param in REQUEST_ERROR_MARKERS:
        if reason and marker in reason:
            return InvalidRequestError(message, param=param)
    return GenerationError(message)


def fail_fast(choice: ChoiceState, num_choices: int, constraint_param: str | None = None) -> None:
    """Non-streaming: a response cannot carry both an error and choices, so a choice that ended with
    finish_reason "error" makes the whole response its error, at once. The handler's loop closes
    generate_all as this leaves it, which aborts the other sequences in the engine instead of
    generating them for nobody. A choice the slo scheduler shed makes the response a 429."""
    if choice.finish_reason == "shed":
        raise shed_error(choice.error, choice.retry_after)
    if choice.finish_reason != "error":
        return
    error = sequence_error(choice.index, choice.error, constraint_param)
    others = num_choices - 1
    if others and not (choice.error or "").startswith(CONSTRAINT_ERROR_PREFIX):
        what = "choice was" if others == 1 else "choices were"
        error.message += f"; the request's {others} other {what} discarded"
    raise error


def exception_event(exc: TokenmillError) -> str:
    body = ErrorResponse.from_exception(exc)
    return f"data: {body.model_dump_json()}\n\n"


def stream_failure_event(exc: BaseException) -> str:
    """The error event that ends a stream whose generation raised."""
    if isinstance(exc, TokenmillError):
        return exception_event(exc)
    logger.error("streaming a response failed", exc_info=exc)
    return error_event(f"internal error: {type(exc).__name__}: {exc}")


async def wait_for_disconnect(receive) -> None:
    """Returns once the client has gone away (the body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
