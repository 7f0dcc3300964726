"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tokenmill.chat_template import render_chat
from tokenmill.outputs import PositionLogprobs
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
    random_id,
    sse_event,
)
from tokenmill.server.serving_common import (
    ChoiceState,
    EventStream,
    PreparedPrompt,
    RunStatus,
    admit,
    fail_fast,
    finish_event,
    generate_all,
    make_usage,
    raise_if_never_started,
    stream_failure_event,
    tokenize_off_loop,
    validate_prompts,
)
from tokenmill.server.state import ServerState


def prepare_chat_prompt(state: ServerState, request: ChatCompletionRequest) -> PreparedPrompt:
    token_ids = render_chat(
        state.tokenizer("messages"),
        request.messages_for_template(),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    return PreparedPrompt(text=None, token_ids=token_ids)


def _chat_logprobs(
    state: ServerState, positions: list[PositionLogprobs], token_ids: list[int], k: int
) -> ChatCompletionLogprobs:
    decode = state.engine.output_processor.decode_token  # type: ignore[union-attr]
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        token = decode(token_id)
        chosen = position.get(token_id)
        ranked = sorted(
            (lp.rank, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k
        )
        top = [
            ChatCompletionLogprob(
                token=lp.decoded_token or decode(tid),
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


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest):
    """Returns a ChatCompletionResponse, or an async iterator of SSE strings when streaming."""
    state.check_model(request.model)
    params = request.to_sampling_params(None)  # type: ignore[arg-type]  # None: up to the context length
    num_chars = sum(len(m.text()) for m in request.messages)
    prompt = await tokenize_off_loop(num_chars, prepare_chat_prompt, state, request)
    validate_prompts(state, [prompt], params, request.priority, request.cache_salt)
    request_id = random_id("chatcmpl")
    model = request.model or state.model_names[0]
    choices = [ChoiceState(index=j) for j in range(params.n)]
    status = admit(state, [prompt], params, request.request_timeout)
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
        events = _stream(state, request, request_id, model, prompt, choices, outputs, status, top_k)
        return EventStream(events, status)

    cached = 0
    try:
        async for _, out in outputs:
            completion = out.outputs[0]
            choice = choices[completion.index]
            choice.text += completion.text
            choice.token_ids.extend(completion.token_ids)
            if completion.logprobs:
                choice.logprobs.extend(completion.logprobs)
            if out.finished:
                choice.finish_reason = completion.finish_reason
                choice.stop_reason = completion.stop_reason
                choice.error = out.error
                cached = max(cached, out.num_cached_tokens)
                fail_fast(choice, len(choices))
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # left early: aborts the rest
    raise_if_never_started(status, choices)
    response_choices = [
        ChatCompletionResponseChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_chat_logprobs(state, c.logprobs, c.token_ids, top_k) if request.logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in choices
    ]
    return ChatCompletionResponse(
        id=request_id, model=model, choices=response_choices, usage=make_usage([prompt], choices, cached)
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
) -> AsyncIterator[str]:
    def chunk(index: int, delta: DeltaMessage, **fields) -> str:
        choice = ChatCompletionStreamChoice(index=index, delta=delta, **fields)
        return sse_event(ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice]))

    cached = 0
    try:
        for choice in choices:
            yield chunk(choice.index, DeltaMessage(role="assistant", content=""))
        async for _, out in outputs:
            completion = out.outputs[0]
            choice = choices[completion.index]
            choice.token_ids.extend(completion.token_ids)
            wants_logprobs = request.logprobs and bool(completion.logprobs)
            if not completion.text and not out.finished and not wants_logprobs:
                continue
            logprobs = None
            if wants_logprobs:
                logprobs = _chat_logprobs(state, list(completion.logprobs), completion.token_ids, top_k)
            if out.finished:
                cached = max(cached, out.num_cached_tokens)
                choice.finish_reason = completion.finish_reason
                event = finish_event(status, 0, choice.index, out)
                if event is not None:
                    yield event
            yield chunk(
                choice.index,
                DeltaMessage(content=completion.text) if completion.text else DeltaMessage(),
                logprobs=logprobs,
                finish_reason=completion.finish_reason if out.finished else None,
                stop_reason=completion.stop_reason if out.finished else None,
            )
        if request.include_usage_in_stream:
            usage = make_usage([prompt], choices, cached)
            yield sse_event(ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage))
    except Exception as exc:  # the stream has started: the error can only travel as an event
        yield stream_failure_event(exc)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
