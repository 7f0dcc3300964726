"""What flows out of the scheduler (to the model runner) and back, and out of the engine core.

`EngineCoreOutput` is a msgspec struct: the same object is used in-process and sent over ZMQ
(msgpack, never pickle) to the API server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tokenmill.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table (the list the KV manager owns)
    is_new: bool  # first scheduled, or resumed after preemption: the runner (re)builds its state
    # The chunk reaches the request's last token (known, or still in flight): a new one is sampled.
    samples_token: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Requests that ended (finished, aborted, errored) since the previous step: the runner drops
    # their per-request state (sampling generators, cached metadata).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top alternatives by rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token (1 = most likely)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Result of one step, in plain Python lists (one host sync brought them back)."""

    # Requests that sampled a token this step, in the order they were scheduled.
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None  # parallel to req_ids
    # Prompt logprobs of this step's chunk, per request that asked (first prompt position: None).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Requests that failed this step (e.g. NaN logits): request id -> reason. They end with
    # finish_reason "error"; nothing else in the batch is disturbed.
    errored: dict[str, str] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # Seconds from arrival to first being scheduled; set on a request's first output only.
    queue_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
