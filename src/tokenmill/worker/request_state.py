"""The runner's own per-request state (its persistent batch), kept across steps.

Built from a request's `NewRequestData` the first step it is scheduled, updated from the
scheduler's diffs (new block ids) and from the tokens the runner itself
samples. The runner never reads the scheduler's `core.Request`, so the scheduler output can come
from another process.
"""

from __future__ import annotations

import numpy as np

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
        "row",
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
        self.row = -1  # its row in the owner's BlockTables (-1: none)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens on the host (a copy; only sampling with penalties or min_tokens
        reads them, and then every earlier token is on the host)."""
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return f"RequestState({self.request_id!r}, tokens={len(self.token_ids)}/{self.num_tokens})"


class BlockTables:
    """Every held request's block ids, per KV cache group, as one numpy row each (`RequestState.row`),
    written as the scheduler's diffs arrive: a step's block tables are then one gather, where
    converting every request's whole table from Python ints cost ~50 us a step (64 requests of
    ~30 blocks). The rows mirror the states' `block_ids` lists; cells past a table's length hold
    stale ids, and readers take only the cells their sequences cover."""

    def __init__(self) -> None:
        self._groups: list[np.ndarray] = []  # [rows, width] int32 per group
        self._free: list[int] = []
        self._num_rows = 0

    def group(self, group: int) -> np.ndarray:
        return self._groups[group]

    def add(self, state: RequestState) -> None:
        if not self._groups:
            self._groups = [np.zeros((16, 64), dtype=np.int32) for _ in state.block_ids]
        if not self._free:
            grown = max(16, 2 * self._num_rows)
            if grown > self._groups[0].shape[0]:
                self._groups = [self._resized(g, grown, g.shape[1]) for g in self._groups]
            self._free.extend(range(grown - 1, self._num_rows - 1, -1))
            self._num_rows = grown
        state.row = self._free.pop()
        for group, table in enumerate(state.block_ids):
            self.write(state, group, 0, table)

    def write(self, state: RequestState, group: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        table = self._groups[group]
        if end > table.shape[1]:
            table = self._groups[group] = self._resized(table, table.shape[0], max(end, 2 * table.shape[1]))
        if end - start == 1:  # the common diff (one new block): a scalar write is ~10x cheaper
            table[state.row, start] = block_ids[0]
        else:
            table[state.row, start:end] = block_ids

    def remove(self, state: RequestState) -> None:
        self._free.append(state.row)
        state.row = -1

    @staticmethod
    def _resized(table: np.ndarray, rows: int, width: int) -> np.ndarray:
        grown = np.zeros((rows, width), dtype=np.int32)
        grown[: table.shape[0], : table.shape[1]] = table
        return grown


class RequestStates:
    """Every request the runner holds state for, by id."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.tables = BlockTables()

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
        tables = self.tables
        for request_id in so.finished_req_ids:
            state = states.pop(request_id, None)
            if state is not None:
                tables.remove(state)
        for request_id in so.preempted_req_ids:
            state = states.pop(request_id, None)
            if state is not None:
                tables.remove(state)
        cached = so.scheduled_cached_reqs
        batch = [states[request_id] for request_id in cached.request_ids]
        for request_id, new_block_ids in cached.new_block_ids.items():
            state = states[request_id]
            for group, (table, new_ids) in enumerate(zip(state.block_ids, new_block_ids, strict=True)):
                if new_ids:
                    tables.write(state, group, len(table), new_ids)
                    table.extend(new_ids)
        for new in so.scheduled_new_reqs:
            old = states.get(new.request_id)
            if old is not None:  # sent as new again while held (not expected): its row is replaced
                tables.remove(old)
            state = states[new.request_id] = RequestState(new)
            tables.add(state)
            batch.append(state)
        return batch
