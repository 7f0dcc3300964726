"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenmill.engine.otel_spans import TraceContext
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import PositionLogprobs
from tokenmill.server.protocol import (
    SSE_DONE,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
    sse_event,
)
from tokenmill.server.request_fields import (
    check_kv_transfer,
    check_priority,
    check_slo_targets,
    truncate_prompt,
)
from tokenmill.server.serving_common import (
    ChoiceState,
    EventStream,
    PreparedPrompt,
    RunStatus,
    admit,
    check_first_output,
    fail_fast,
    finish_event,
    generate_all,
    make_usage,
    raise_if_never_started,
    stream_failure_event,
    stream_waits_for_first_output,
    token_namer,
    tokenize_off_loop,
    validate_prompts,
)
from tokenmill.server.state import ServerState
from tokenmill.server.stream_events import TextDeltaEvents

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def prepare_prompts(state: ServerState, request: CompletionRequest) -> list[PreparedPrompt]:
    processor = state.engine.input_processor
    assert processor is not None
    prepared = []
    for prompt in request.prompts():
        if isinstance(prompt, str) and not request.add_special_tokens and prompt:
            text, token_ids = prompt, state.tokenizer("prompt").encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = processor.tokenize(prompt)
        if request.truncate_prompt_tokens is not None:
            token_ids = truncate_prompt(token_ids, request.truncate_prompt_tokens, state.max_model_len)
            text = None  # the text no longer matches the tokens the model sees
        prepared.append(PreparedPrompt(text=text, token_ids=token_ids))
    return prepared


def _completion_logprobs(
    state: ServerState,
    positions: list[PositionLogprobs | None],
    token_ids: list[int],
    k: int,
    start_offset: int,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    name = token_namer(state, as_token_ids)
    result = CompletionLogprobs()
    offset = start_offset
    for token_id, position in zip(token_ids, positions, strict=False):
        token = name(token_id, None)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        chosen = position.get(token_id)
        result.token_logprobs.append(chosen.logprob if chosen else None)
        top = {}
        for tid, lp in position.items():
            if tid == token_id or (lp.rank is not None and lp.rank <= k):
                top[name(tid, lp.decoded_token)] = lp.logprob
        result.top_logprobs.append(top)
    return result


async def create_completion(
    state: ServerState, request: CompletionRequest, trace: TraceContext | None = None, received: float | None = None
):
    """Returns a CompletionResponse, or an async iterator of SSE strings when streaming.

    `received`: when its HTTP request reached the route; its generation counts its arrival from
    then (None: once it is tokenized).
    """
    lora = state.resolve_model(request.model)  # the adapter `model` names; None: the base model
    params = request.to_sampling_params(DEFAULT_COMPLETION_MAX_TOKENS, state.default_sampling)
    check_priority(state, request.priority)
    check_slo_targets(state, params)
    check_kv_transfer(state, request)
    if request.echo and request.stream and request.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported when streaming", param="echo")
    if request.echo:
        state.tokenizer("echo")  # echoing token-id prompts needs their text: refuse before generating
    num_chars = sum(len(p) for p in request.prompts() if isinstance(p, str))
    prompts = await tokenize_off_loop(num_chars, prepare_prompts, state, request)
    validate_prompts(state, prompts, params, request.priority, request.cache_salt)
    request_id = request.request_id or random_id("cmpl")
    model = request.model or state.model_names[0]
    n = params.n
    # OpenAI numbers the choices of prompt i as i * n + j.
    choices = [ChoiceState(index=i * n + j) for i in range(len(prompts)) for j in range(n)]
    status = admit(state, prompts, params, request.request_timeout, request.constraint_param, lora)
    status.trace = trace
    status.arrival = received
    outputs = generate_all(
        state,
        request_id,
        prompts,
        params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        status=status,
    )
    if request.stream:
        if stream_waits_for_first_output(state, params):
            outputs = await check_first_output(outputs, status)
        return EventStream(
            _stream(state, request, request_id, model, prompts, choices, outputs, status), status
        )

    cached = [0] * len(prompts)
    prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
    try:
        async for i, out in outputs:
            completion = out.outputs[0]
            choice = choices[i * n + completion.index]
            choice.text += completion.text
            choice.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                choice.logprobs.extend(completion.logprobs)
            if out.prompt_logprobs:
                prompt_logprobs[i] = out.prompt_logprobs
            if out.finished:
                choice.finish_reason = completion.finish_reason
                choice.stop_reason = completion.stop_reason
                choice.error = out.error
                choice.retry_after = out.metrics.get("retry_after")
                cached[i] = max(cached[i], out.num_cached_tokens)
                fail_fast(choice, len(choices), status.constraint_param)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # left early: aborts the rest
    raise_if_never_started(status, choices)
    response_choices = []
    for choice in choices:
        i = choice.index // n
        prompt = prompts[i]
        text = choice.text
        logprobs = None
        if request.echo:
            text = _prompt_text(state, prompt) + text
        if request.logprobs is not None:
            if request.echo:
                prompt_positions = list(prompt_logprobs[i] or [None] * len(prompt.token_ids))
                logprobs = _completion_logprobs(
                    state,
                    prompt_positions + list(choice.logprobs),
                    prompt.token_ids + choice.token_ids,
                    request.logprobs,
                    0,
                    request.return_tokens_as_token_ids,
                )
            else:
                logprobs = _completion_logprobs(
                    state, list(choice.logprobs), choice.token_ids, request.logprobs, 0,
                    request.return_tokens_as_token_ids,
                )  # fmt: skip
        response_choices.append(
            CompletionResponseChoice(
                index=choice.index,
                text=text,
                logprobs=logprobs,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
        )
    return CompletionResponse(
        id=request_id, model=model, choices=response_choices, usage=make_usage(prompts, choices, sum(cached))
    )


def _prompt_text(state: ServerState, prompt: PreparedPrompt) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer("echo").decode(prompt.token_ids)


async def _stream(
    state: ServerState,
    request: CompletionRequest,
    request_id: str,
    model: str,
    prompts: list[PreparedPrompt],
    choices: list[ChoiceState],
    outputs: AsyncIterator,
    status: RunStatus,
) -> AsyncIterator[str]:
    created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's

    def chunk(choice: CompletionResponseChoice, usage: UsageInfo | None = None) -> str:
        return sse_event(
            CompletionStreamResponse(id=request_id, model=model, created=created, choices=[choice], usage=usage)
        )

    text_events = TextDeltaEvents(
        CompletionStreamResponse(id=request_id, model=model, created=created, choices=[]),
        lambda index, text: CompletionResponseChoice(index=index, text=text),
    )
    n = request.n
    cached = [0] * len(prompts)
    text_offsets = [0] * len(choices)
    try:
        if request.echo:
            for choice in choices:
                prompt_text = _prompt_text(state, prompts[choice.index // n])
                text_offsets[choice.index] = len(prompt_text)
                yield chunk(CompletionResponseChoice(index=choice.index, text=prompt_text))
        async for i, out in outputs:
            completion = out.outputs[0]
            choice = choices[i * n + completion.index]
            choice.token_ids.extend(completion.token_ids)
            wants_logprobs = request.logprobs is not None and bool(completion.logprobs)
            if not completion.text and not out.finished and not wants_logprobs:
                continue
            logprobs = None
            if wants_logprobs:
                logprobs = _completion_logprobs(
                    state,
                    list(completion.logprobs),
                    completion.token_ids,
                    request.logprobs,
                    text_offsets[choice.index],
                    request.return_tokens_as_token_ids,
                )
            text_offsets[choice.index] += len(completion.text)
            if logprobs is None and not out.finished and not request.continuous_usage_stats:
                yield text_events.render(choice.index, completion.text)  # the common case, per token
                continue
            if out.finished:
                cached[i] = max(cached[i], out.num_cached_tokens)
                choice.finish_reason = completion.finish_reason
                event = finish_event(status, i, choice.index, out)
                if event is not None:
                    yield event
            yield chunk(
                CompletionResponseChoice(
                    index=choice.index,
                    text=completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason if out.finished else None,
                    stop_reason=completion.stop_reason if out.finished else None,
                ),
                make_usage(prompts, choices, sum(cached)) if request.continuous_usage_stats else None,
            )
        if request.include_usage_in_stream:
            usage = make_usage(prompts, choices, sum(cached))
            yield sse_event(CompletionStreamResponse(id=request_id, model=model, created=created, choices=[], usage=usage))
    except Exception as exc:  # the stream has started: the error can only travel as an event
        yield stream_failure_event(exc)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
