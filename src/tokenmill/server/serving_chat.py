"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenmill.engine.otel_spans import TraceContext
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import PositionLogprobs
from tokenmill.server.chat_output import ChatOutputParsing, has_content
from tokenmill.server.chat_prompt import render_chat_prompt
from tokenmill.server.chat_tools import plan_tools
from tokenmill.server.protocol import (
    SSE_DONE,
    ChatCompletionLogprob,
    ChatCompletionLogprobs,
    ChatCompletionLogprobsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    PromptLogprob,
    UsageInfo,
    random_id,
    sse_event,
)
from tokenmill.server.request_fields import check_kv_transfer, check_priority, check_slo_targets
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


def _chat_logprobs(
    state: ServerState,
    positions: list[PositionLogprobs],
    token_ids: list[int],
    k: int,
    as_token_ids: bool = False,
) -> ChatCompletionLogprobs:
    name = token_namer(state, as_token_ids)
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        token = name(token_id, None)
        chosen = position.get(token_id)
        ranked = sorted(
            (lp.rank, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k
        )
        top = [
            ChatCompletionLogprob(
                token=name(tid, lp.decoded_token),
                logprob=lp.logprob,
                bytes=list((lp.decoded_token or "").encode()),
            )
            for _, tid, lp in ranked[:k]
        ]
        content.append(
            ChatCompletionLogprobsContent(
                token=token,
                logprob=chosen.logprob if chosen else float("-inf"),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogprobs(content=content)


def _prompt_logprobs(
    state: ServerState, positions: list[PositionLogprobs | None] | None, as_token_ids: bool
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of a chat response: per prompt position, token id -> logprob."""
    if positions is None:
        return None
    name = token_namer(state, as_token_ids)
    return [
        None
        if position is None
        else {
            str(tid): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=name(tid, lp.decoded_token))
            for tid, lp in position.items()
        }
        for position in positions
    ]


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, trace: TraceContext | None = None, received: float | None = None
):
    """Returns a ChatCompletionResponse, or an async iterator of SSE strings when streaming.

    `received`: when its HTTP request reached the route; its generation counts its arrival from
    then (None: once it is tokenized).
    """
    lora = state.resolve_model(request.model)  # the adapter `model` names; None: the base model
    params = request.to_sampling_params(None, state.default_sampling)  # None: up to the context length
    check_priority(state, request.priority)
    check_slo_targets(state, params)
    check_kv_transfer(state, request)
    tool_plan = plan_tools(state, request)
    constraint_param = request.constraint_param
    if tool_plan.constraint is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                f"tool_choice {tool_plan.choice_name} already constrains the output; leave out {constraint_param}",
                param=constraint_param,
            )
        params.structured_outputs = tool_plan.constraint
        constraint_param = "tool_choice"
    num_chars = sum(len(m.text()) for m in request.messages)
    chat_prompt = await tokenize_off_loop(num_chars, render_chat_prompt, state, request)
    parsing = ChatOutputParsing.build(state, request, tool_plan, chat_prompt.text, params)
    prompt = PreparedPrompt(text=None, token_ids=chat_prompt.token_ids)
    validate_prompts(state, [prompt], params, request.priority, request.cache_salt)
    request_id = request.request_id or random_id("chatcmpl")
    model = request.model or state.model_names[0]
    choices = [ChoiceState(index=j) for j in range(params.n)]
    status = admit(state, [prompt], params, request.request_timeout, constraint_param, lora)
    status.trace = trace
    status.arrival = received
    outputs = generate_all(
        state,
        request_id,
        [prompt],
        params,
        priority=request.priority,
        cache_salt=request.cache_salt,
        status=status,
    )
    top_k = request.top_logprobs or 0
    if request.stream:
        if stream_waits_for_first_output(state, params):
            outputs = await check_first_output(outputs, status)
        events = _stream(state, request, request_id, model, prompt, choices, outputs, status, top_k, parsing)
        return EventStream(events, status)

    cached = 0
    prompt_positions = None
    try:
        async for _, out in outputs:
            completion = out.outputs[0]
            choice = choices[completion.index]
            choice.text += completion.text
            choice.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                choice.logprobs.extend(completion.logprobs)
            if out.prompt_logprobs:
                prompt_positions = out.prompt_logprobs
            if out.finished:
                choice.finish_reason = completion.finish_reason
                choice.stop_reason = completion.stop_reason
                choice.error = out.error
                choice.retry_after = out.metrics.get("retry_after")
                cached = max(cached, out.num_cached_tokens)
                fail_fast(choice, len(choices), constraint_param)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # left early: aborts the rest
    raise_if_never_started(status, choices)
    response_choices = []
    echoed = request.echoed_text()
    for c in choices:
        parsed = parsing.parse(c.text)
        if echoed:
            parsed.content = echoed + (parsed.content or "")
        if not request.include_reasoning:
            parsed.reasoning = None
        response_choices.append(
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatResponseMessage(
                    content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=parsed.tool_calls
                ),
                logprobs=_chat_logprobs(state, c.logprobs, c.token_ids, top_k, request.return_tokens_as_token_ids)
                if request.logprobs
                else None,
                finish_reason=parsing.finish_reason(c.finish_reason, bool(parsed.tool_calls)),
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=response_choices,
        usage=make_usage([prompt], choices, cached),
        prompt_logprobs=_prompt_logprobs(state, prompt_positions, request.return_tokens_as_token_ids),
    )


async def _stream(
    state: ServerState,
    request: ChatCompletionRequest,
    request_id: str,
    model: str,
    prompt: PreparedPrompt,
    choices: list[ChoiceState],
    outputs: AsyncIterator,
    status: RunStatus,
    top_k: int,
    parsing: ChatOutputParsing,
) -> AsyncIterator[str]:
    created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's

    def chunk(index: int, delta: DeltaMessage, usage: UsageInfo | None = None, **fields) -> str:
        choice = ChatCompletionStreamChoice(index=index, delta=delta, **fields)
        return sse_event(
            ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[choice], usage=usage)
        )

    text_events = TextDeltaEvents(
        ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[]),
        lambda index, text: ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text)),
    )

    cached = 0
    streams = [parsing.stream() for _ in choices]
    continuous_usage = request.continuous_usage_stats
    try:
        echoed = request.echoed_text()
        for choice in choices:
            yield chunk(choice.index, DeltaMessage(role="assistant", content=echoed))
        async for _, out in outputs:
            completion = out.outputs[0]
            choice = choices[completion.index]
            choice.token_ids.extend(completion.token_ids)
            stream = streams[completion.index]
            delta = stream.feed(completion.text) if completion.text else DeltaMessage()
            if out.finished:
                delta = stream.finish(delta)
            if not request.include_reasoning:
                delta.reasoning_content = None
            wants_logprobs = request.logprobs and bool(completion.logprobs)
            if not out.finished and not wants_logprobs and not has_content(delta):
                continue
            logprobs = None
            if wants_logprobs:
                logprobs = _chat_logprobs(
                    state, list(completion.logprobs), completion.token_ids, top_k, request.return_tokens_as_token_ids
                )
            if logprobs is None and not out.finished and not continuous_usage and _text_only(delta):
                yield text_events.render(choice.index, delta.content)  # the common case, per token
                continue
            if out.finished:
                cached = max(cached, out.num_cached_tokens)
                choice.finish_reason = completion.finish_reason
                event = finish_event(status, 0, choice.index, out)
                if event is not None:
                    yield event
            yield chunk(
                choice.index,
                delta,
                make_usage([prompt], choices, cached) if continuous_usage else None,
                logprobs=logprobs,
                finish_reason=parsing.finish_reason(completion.finish_reason, stream.tools_called)
                if out.finished
                else None,
                stop_reason=completion.stop_reason if out.finished else None,
            )
        if request.include_usage_in_stream:
            usage = make_usage([prompt], choices, cached)
            yield sse_event(ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[], usage=usage))
    except Exception as exc:  # the stream has started: the error can only travel as an event
        yield stream_failure_event(exc)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


# Every DeltaMessage field but content: a delta with all of them None is a plain text delta.
_NON_TEXT_DELTA_FIELDS = tuple(name for name in DeltaMessage.model_fields if name != "content")


def _text_only(delta: DeltaMessage) -> bool:
    return delta.content is not None and all(getattr(delta, name) is None for name in _NON_TEXT_DELTA_FIELDS)
