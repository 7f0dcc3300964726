"""Turns engine-core outputs into user-facing RequestOutputs.

Lives on the client side (the API server process in `serve`): incremental detokenization, stop
strings and logprob decoding happen here so the engine loop stays busy. A stop-string match ends
the request here, and the caller aborts it in the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.outputs import EngineCoreOutput, TokenLogprobs
from tokenmill.engine.detokenizer import IncrementalDetokenizer, decode_token
from tokenmill.engine.stop_strings import StopStringMatcher
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """One sequence being generated (a child when n > 1)."""

    request_id: str  # the engine's id for this sequence
    parent_id: str  # the user's request id
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    stream: bool
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    sent_text_len: int = 0
    sent_tokens_len: int = 0
    sent_logprobs_len: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time: float | None = None
    retry_after: float | None = None  # finish_reason "shed": when a retry may succeed


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Sequences that a stop string ended here: the caller aborts them in the engine.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._decoded_cache: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        detokenizer = None
        if params.detokenize and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.states[request_id] = RequestState(
            request_id=request_id,
            parent_id=parent_id,
            index=index,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detokenizer,
            stop_matcher=matcher,
            stream=stream,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded_cache.get(token_id)
        if text is None:
            text = decode_token(self.tokenizer, token_id)
            if len(self._decoded_cache) < 200_000:
                self._decoded_cache[token_id] = text
        return text

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        chosen = entry.token_ids[0]
        result[chosen] = Logprob(entry.logprobs[0], entry.rank, self.decode_token(chosen))
        for rank, (token_id, logprob) in enumerate(
            zip(entry.token_ids[1:], entry.logprobs[1:], strict=True), start=1
        ):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self.decode_token(token_id))
        return result

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> ProcessedOutputs:
        now = time.monotonic() if now is None else now
        processed = ProcessedOutputs()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # already ended here (stop string) or aborted by the caller
            self._apply(state, out, now, processed)
            if state.finish_reason is not None:
                del self.states[state.request_id]
            processed.request_outputs.append(self._make_output(state))
        return processed

    def _apply(
        self, state: RequestState, out: EngineCoreOutput, now: float, processed: ProcessedOutputs
    ) -> None:
        state.num_cached_tokens = out.num_cached_tokens
        if out.queue_time is not None:
            state.queue_time = out.queue_time
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            for entry in out.new_prompt_logprobs:
                state.prompt_logprobs.append(None if entry is None else self._position_logprobs(entry))
        if out.new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            state.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and state.logprobs is not None:
                for entry in out.new_logprobs:
                    state.logprobs.append(self._position_logprobs(entry))
                    state.cumulative_logprob += entry.logprobs[0]
            if state.detokenizer is not None:
                new_text = state.detokenizer.add_tokens(out.new_token_ids)
                if out.finish_reason is not None:
                    new_text += state.detokenizer.flush()  # text held back for an unfinished character
                state.text += new_text
                # Like EOS, stop strings only count once min_tokens have been produced.
                if (
                    state.stop_matcher is not None
                    and new_text
                    and len(state.token_ids) >= state.params.min_tokens
                ):
                    match = state.stop_matcher.find(state.text, len(new_text))
                    if match is not None:
                        stop_str, keep_len = match
                        state.text = state.text[:keep_len]
                        state.finish_reason = "stop"
                        state.stop_reason = stop_str
                        processed.reqs_to_abort.append(state.request_id)
                        return
        if out.finish_reason is not None:
            state.finish_reason = out.finish_reason
            state.stop_reason = out.stop_reason
            state.error = out.error
            state.retry_after = out.retry_after

    def _make_output(self, state: RequestState) -> RequestOutput:
        finished = state.finish_reason is not None
        if state.stream:
            # Delta mode: only what the client has not seen; text that might be the start of a
            # stop string is held back until it is known not to be one.
            visible = len(state.text)
            if not finished and state.stop_matcher is not None:
                visible = max(state.sent_text_len, visible - state.stop_matcher.partial_match_len(state.text))
            text = state.text[state.sent_text_len : visible]
            token_ids = state.token_ids[state.sent_tokens_len :]
            logprobs = state.logprobs[state.sent_logprobs_len :] if state.logprobs is not None else None
            state.sent_text_len = visible
            state.sent_tokens_len = len(state.token_ids)
            state.sent_logprobs_len = len(state.logprobs) if state.logprobs is not None else 0
        else:
            text, token_ids, logprobs = state.text, list(state.token_ids), state.logprobs
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        metrics: dict[str, float] = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if state.last_token_time is not None:
            metrics["last_token_time"] = state.last_token_time
        if state.queue_time is not None:
            metrics["queue_time"] = state.queue_time
        if state.retry_after is not None:
            metrics["retry_after"] = state.retry_after
        output = RequestOutput(
            request_id=state.parent_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            metrics=metrics,
        )
        return output
