"""The current step's token -> adapter-slot mapping, which every LoRA layer of the step reads.

On a GPU it lives in persistent device buffers (tokens grouped by slot: `sorted_token_ids`, and
per slot where its tokens start and how many there are), refilled through pinned memory before
each step, so CUDA graphs captured once replay with any mix of adapters. On the CPU it is a list
of contiguous token runs per slot (a request's tokens are contiguous in the batch).
"""

from __future__ import annotations

import numpy as np
import torch


class LoRAStepMapping:
    def __init__(self, num_slots: int, max_tokens: int, max_shrunk_width: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_tokens = max_tokens
        self.use_kernels = device.type == "cuda"
        # Whether any token of the step has an adapter: layers add nothing otherwise (and the
        # runner replays the graphs captured without LoRA).
        self.active = False
        self.segments: list[tuple[int, int, int]] = []  # CPU: (slot, first token, end)
        if self.use_kernels:
            size = max_tokens + 2 * num_slots
            self._host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
            self._device = torch.zeros(size, dtype=torch.int32, device=device)
            self.sorted_token_ids = self._device[:max_tokens]
            self.slot_starts = self._device[max_tokens : max_tokens + num_slots]
            self.slot_counts = self._device[max_tokens + num_slots :]
            from tokenmill.kernels.triton.lora import lora_scratch

            # The shrink's float32 output, [tokens, parts * R] viewed per layer, and its split-K
            # partials: one layer's LoRA runs at a time, so every layer shares them.
            self.shrunk = torch.empty(max_tokens * max_shrunk_width, dtype=torch.float32, device=device)
            self.scratch = lora_scratch(max_tokens, num_slots, max_shrunk_width, device)

    def set(self, token_slots: np.ndarray) -> None:
        """`token_slots`: the slot of each token row of the step (-1: no adapter). On a GPU the copy
        is queued on the current stream; the caller has made the pinned buffer free to reuse."""
        with_adapter = token_slots >= 0
        self.active = bool(with_adapter.any())
        if not self.active:
            return
        if len(token_slots) > self.max_tokens:
            raise ValueError(f"a step of {len(token_slots)} tokens exceeds LoRA's buffers ({self.max_tokens})")
        if not self.use_kernels:
            self.segments = _runs(token_slots)
            return
        valid = np.flatnonzero(with_adapter)
        slots = token_slots[valid]
        order = valid[np.argsort(slots, kind="stable")]
        counts = np.bincount(slots, minlength=self.num_slots)
        starts = np.zeros(self.num_slots, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        host = self._host.numpy()
        n, m = len(order), self.max_tokens
        host[:n] = order
        host[m : m + self.num_slots] = starts
        host[m + self.num_slots :] = counts
        self._device[:n].copy_(self._host[:n], non_blocking=True)
        self._device[m:].copy_(self._host[m:], non_blocking=True)

    def clear(self) -> None:
        self.active = False
        self.segments = []


def _runs(token_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each maximal run of equal slots >= 0."""
    change = np.flatnonzero(np.diff(token_slots)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [len(token_slots)]))
    return [(int(token_slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True) if token_slots[s] >= 0]
