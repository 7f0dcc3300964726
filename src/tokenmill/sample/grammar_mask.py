"""Applying a step's grammar bitmask to the logits on the device (xgrammar's kernels).

The engine core fills the bitmask on the host (`engine/structured_output/`); this puts its rows
at the logits rows of their requests (all tokens allowed elsewhere) and sets every disallowed
logit to -inf in place, before any sampling. On CUDA the host rows go through a pinned buffer
with a non-blocking copy, so the launch does not wait for the device. On the CPU, float32 logits
are masked with numpy from the unpacked bits (faster than xgrammar's CPU kernel).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.outputs import GrammarOutput


class GrammarMasker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # [rows, words] int32, reused step after step: a constrained step's mask is written only
        # after the engine has waited for the previous step's sampled tokens (async scheduling
        # applies them between a step's forward and its mask), and that step's copy out of this
        # buffer was queued before its sampling, so it has finished by then.
        self._pinned: torch.Tensor | None = None

    def _host_buffer(self, num_rows: int, num_words: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty((num_rows, num_words), dtype=torch.int32)
        pinned = self._pinned
        if pinned is None or pinned.shape[0] < num_rows or pinned.shape[1] != num_words:
            pinned = torch.empty((max(num_rows, 64), num_words), dtype=torch.int32, pin_memory=True)
            self._pinned = pinned
        return pinned[:num_rows]

    def warm_up(self, vocab_size: int) -> int:
        """Compile xgrammar's mask kernel now, for every row-count variant a step can launch, rather
        than in the first constrained steps of a served engine: Triton specialises an integer
        argument that is 1 or a multiple of 16, so 1, 2 and 16 rows cover all. Unwarmed, the three
        compiles (~0.1 s each, plus ~0.35 s building Triton's launcher on a machine with an empty
        cache) stalled every request of the first constrained wave on an H200. Float32 logits, as
        `compute_logits` makes them. Returns the variants launched (0: no CUDA or no xgrammar)."""
        if self.device.type != "cuda":
            return 0
        try:
            import xgrammar as xgr
        except ImportError:  # structured output unavailable: nothing will launch the kernel
            return 0
        num_words = -(-vocab_size // 32)
        rows_variants = (1, 2, 16)
        for rows in rows_variants:
            logits = torch.zeros((rows, vocab_size), dtype=torch.float32, device=self.device)
            bitmask = torch.full((rows, num_words), -1, dtype=torch.int32, device=self.device)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        return len(rows_variants)

    def apply(self, logits: torch.Tensor, grammar: GrammarOutput, row_of: dict[str, int]) -> None:
        """Mask `logits` ([sampling rows, vocab]) in place; `row_of` maps a request id to its
        first logits row (its rows_per_request rows follow it)."""
        import xgrammar as xgr

        num_rows, num_words = logits.shape[0], -(-logits.shape[-1] // 32)
        # Grammar rows cover the tokenizer's vocabulary; logits past it stay masked (0 bits).
        grammar_words = grammar.num_words
        rows = np.frombuffer(grammar.bitmask, dtype="<i4").reshape(-1, grammar_words)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
            _apply_unpacked(logits.numpy(), rows, grammar, row_of)
            return
        host = self._host_buffer(num_rows, num_words)
        host_np = host.numpy()
        # The logits row of each grammar row, in one index array: one numpy copy for all rows,
        # instead of two per request on the step's critical path (64 requests: ~0.2 ms on the H200
        # host, from a py-spy profile of the served constrained phase).
        starts = np.fromiter((row_of[r] for r in grammar.request_ids), dtype=np.int64, count=len(grammar.request_ids))
        counts = np.asarray(grammar.rows_per_request, dtype=np.int64)
        first = np.cumsum(counts) - counts  # each request's first grammar row
        dst = np.repeat(starts - first, counts) + np.arange(len(rows))
        if len(dst) < num_rows:
            # Every token allowed in the rows of unconstrained requests. numpy, not `host.fill_`:
            # torch runs that 1 MB fill on its OpenMP team, 7 ms instead of 0.03 when a thread of it
            # is descheduled (2 threads on the busy 2-core dev machine).
            host_np.fill(-1)
        if np.array_equal(dst, np.arange(len(dst))):  # rows 0..n-1 in order (the common case): slices
            host_np[: len(dst), :grammar_words] = rows
            host_np[: len(dst), grammar_words:] = 0
        else:
            host_np[dst, :grammar_words] = rows
            host_np[dst, grammar_words:] = 0
        if logits.is_cuda:
            # All rows (the unconstrained ones allow everything): row indices would be one more
            # host-to-device copy from pageable memory.
            bitmask = host.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
        else:
            xgr.apply_token_bitmask_inplace(logits, host, vocab_size=logits.shape[-1], indices=dst.tolist())


def _apply_unpacked(logits: np.ndarray, rows: np.ndarray, grammar: GrammarOutput, row_of: dict[str, int]) -> None:
    """The CPU path: unpack the bits once (numpy, vectorised) and write -inf where a bit is 0.
    xgrammar's CPU kernel tests one bit at a time: 35-60 ms for 64 rows of a 128K vocabulary on
    the development machine, this 15 ms (BENCHMARKS.md, issue 14)."""
    vocab = logits.shape[-1]
    covered = min(vocab, rows.shape[1] * 32)
    disallowed = np.unpackbits(rows.view(np.uint8), axis=1, count=covered, bitorder="little")
    disallowed ^= 1
    mask = disallowed.view(np.bool_)
    src = 0
    for request_id, count in zip(grammar.request_ids, grammar.rows_per_request, strict=True):
        dst = row_of[request_id]
        np.copyto(logits[dst : dst + count, :covered], -np.inf, where=mask[src : src + count])
        logits[dst : dst + count, covered:] = -np.inf
        src += count
