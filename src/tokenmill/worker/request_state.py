"""The runner's own per-request state (its persistent batch), kept across steps.

Built from a request's `NewRequestData` the first step it is scheduled, updated from the
scheduler's diffs (new block ids) and from the tokens the runner itself
samples. The runner never reads the scheduler's `core.Request`, so the scheduler output can come
from another process.
"""

from __future__ import annotations

from tokenmill.core.outputs import NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


class RequestState:
    __slots__ = (
        "request_id",
        "sampling_params",
        "eos_token_ids",
        "prompt_token_ids",
        "num_prompt_tokens",
        "token_ids",
        "num_tokens",
        "block_ids",
        "is_plain_greedy",
        "lora_request",
    )

    def __init__(self, new: NewRequestData) -> None:
        self.request_id = new.request_id
        self.sampling_params: SamplingParams = new.sampling_params
        self.eos_token_ids = new.eos_token_ids
        self.prompt_token_ids = new.prompt_token_ids  # read only
        self.num_prompt_tokens = len(new.prompt_token_ids)
        # Prompt + output tokens whose ids the host has.
        self.token_ids = [*new.prompt_token_ids, *new.output_token_ids]
        # Those plus the tokens sampled by launched steps whose ids have not reached the host yet
        # (async scheduling): a chunk that reaches num_tokens samples a new token.
        self.num_tokens = len(self.token_ids)
        # Per KV cache group, own copies: the diffs extend them. A sliding group's entries that slid
        # out keep their old ids here (see core/outputs.py: nothing reads them).
        self.block_ids = [list(table) for table in new.block_ids]
        self.is_plain_greedy = new.sampling_params.is_plain_greedy
        self.lora_request = new.lora_request

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens on the host (a copy; only sampling with penalties or min_tokens
        reads them, and then every earlier token is on the host)."""
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return f"RequestState({self.request_id!r}, tokens={len(self.token_ids)}/{self.num_tokens})"


class RequestStates:
    """Every request the runner holds state for, by id."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def lora_ids(self) -> set[int]:
        """The adapters of every request held (LoRA keeps their device slots)."""
        return {s.lora_request.lora_int_id for s in self.states.values() if s.lora_request is not None}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def update(self, so: SchedulerOutput) -> list[RequestState]:
        """Apply a step's scheduler output; returns the step's requests in batch order.

        Ended and preempted requests are dropped first (a preempted one comes back later as new,
        with its output so far), so a request id reused by a new request starts clean.
        """
        states = self.states
        for request_id in so.finished_req_ids:
            states.pop(request_id, None)
        for request_id in so.preempted_req_ids:
            states.pop(request_id, None)
        cached = so.scheduled_cached_reqs
        batch = [states[request_id] for request_id in cached.request_ids]
        for request_id, new_block_ids in cached.new_block_ids.items():
            for table, new_ids in zip(states[request_id].block_ids, new_block_ids, strict=True):
                table.extend(new_ids)
        for new in so.scheduled_new_reqs:
            state = states[new.request_id] = RequestState(new)
            batch.append(state)
        return batch
