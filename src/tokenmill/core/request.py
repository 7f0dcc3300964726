"""A request as the scheduler sees it: token ids, how many are computed, and a status machine."""

from __future__ import annotations

import enum
import time

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Its structured-output grammar is compiling: not schedulable yet, and no one waits behind it.
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is terminal.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    # The `slo` policy gave up on it before it started: it could no longer meet its latency target.
    FINISHED_SHED = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_SHED: "shed",
}


class Request:
    """Prompt + output tokens and the progress made on them.

    The scheduler never talks of prefill or decode: a request has `num_tokens` known tokens, of
    which `num_computed_tokens` already have KV in the cache; each step computes some of the rest.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_request",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "error",
        "block_hashes",
        "max_tokens",
        "spec_token_ids",
        "use_structured_output",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value = scheduled first (vLLM's convention)
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # None: the base model
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): counted by the scheduler,
        # their ids reach the host only when the step's results are processed.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit, set when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Hashes of the full blocks of all_token_ids, filled in by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Resolved output limit (sampling_params.max_tokens, or what the context leaves).
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        # Draft tokens proposed after the last known token (speculative decoding sets them; the
        # scheduler moves them into the next step it schedules the request in).
        self.spec_token_ids: list[int] = []
        # A grammar constrains its output (the engine core's structured-output manager keeps the
        # matcher, by request id).
        self.use_structured_output = sampling_params.structured_outputs is not None

    @property
    def block_hash_extra_key(self) -> str | None:
        """What the first KV block's hash carries beside the tokens: the cache salt and the adapter."""
        lora = self.lora_request
        if lora is None:
            return self.cache_salt
        return lora.cache_key if self.cache_salt is None else f"{lora.cache_key}|{self.cache_salt}"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
