"""Persistent device buffers for a step's inputs, fed through pinned host memory.

The same device tensors serve eager steps (sliced to the step's size) and CUDA graphs (captured
on fixed slices), so graph replay needs only copies into them: no allocation, no host sync.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        *,
        num_kv_groups: int = 1,
    ) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_host, self.input_ids = pair((max_num_tokens,), torch.long)
        self.positions_host, self.positions = pair((max_num_tokens,), torch.long)
        self.slot_mapping_host, self.slot_mapping = pair((max_num_tokens,), torch.long)
        self.query_start_loc_host, self.query_start_loc = pair((max_num_reqs + 1,), torch.int32)
        self.seq_lens_host, self.seq_lens = pair((max_num_reqs,), torch.int32)
        # Flat, so a step's [num_reqs, width] view is contiguous whatever its width.
        self.block_tables_host, self.block_tables = pair((max_num_reqs * max_blocks_per_req,), torch.int32)
        # KV cache groups 1.. (sliding-window layers): their own slot mappings and block tables.
        self.group_slot_mapping_host, self.group_slot_mapping = [], []
        self.group_block_tables_host, self.group_block_tables = [], []
        for _ in range(num_kv_groups - 1):
            host, dev = pair((max_num_tokens,), torch.long)
            self.group_slot_mapping_host.append(host)
            self.group_slot_mapping.append(dev)
            host, dev = pair((max_num_reqs * max_blocks_per_req,), torch.int32)
            self.group_block_tables_host.append(host)
            self.group_block_tables.append(dev)
        self.sample_rows_host, self.sample_rows = pair((max(max_num_reqs, max_num_tokens),), torch.long)  # verifying drafts: several per request
        # Async scheduling: which rows of the previous step's sampled ids feed which input rows.
        self.gather_src_host, self.gather_src = pair((max_num_reqs,), torch.long)
        self.gather_dst_host, self.gather_dst = pair((max_num_reqs,), torch.long)
        # Sampled ids and non-finite flags come back through these (flat, so a [2, n] view is
        # contiguous), two in turn: with async scheduling the next step's copy is queued before
        # this step's is read.
        self.sampled_host = [
            torch.zeros(2 * max_num_reqs, dtype=torch.long, pin_memory=pin) for _ in range(2)
        ]
        # Marks the end of the last step's host->device copies. With async scheduling (or a step
        # that samples nothing) they may still be queued when the next step refills the pinned
        # buffers: wait for them first (they run at the start of their step, so this is short).
        self._copies_done = torch.cuda.Event() if pin else None
        self._copies_pending = False

    def begin_step(self) -> None:
        """Call before staging a step's inputs: the pinned buffers are free to overwrite after this."""
        if self._copies_pending and self._copies_done is not None:
            self._copies_done.synchronize()
        self._copies_pending = False

    def end_staging(self) -> None:
        """Call once a step's inputs are staged (its copies are queued on the current stream)."""
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True

    @staticmethod
    def _stage(host: torch.Tensor, device_buf: torch.Tensor, array: np.ndarray, n: int) -> torch.Tensor:
        host_view = host[:n]
        host_view.numpy()[...] = array
        dst = device_buf[:n]
        dst.copy_(host_view, non_blocking=True)
        return dst

    def stage_tokens(
        self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, padded_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = len(input_ids)
        if padded_tokens > n:
            # Padding rows: token 0 at position 0, and a slot of -1 so their K/V are written nowhere.
            input_ids = np.concatenate([input_ids, np.zeros(padded_tokens - n, np.int64)])
            positions = np.concatenate([positions, np.zeros(padded_tokens - n, np.int64)])
            slot_mapping = np.concatenate([slot_mapping, np.full(padded_tokens - n, -1, np.int64)])
        m = len(input_ids)
        return (
            self._stage(self.input_ids_host, self.input_ids, input_ids, m),
            self._stage(self.positions_host, self.positions, positions, m),
            self._stage(self.slot_mapping_host, self.slot_mapping, slot_mapping, m),
        )

    def stage_requests(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, padded_reqs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = len(seq_lens)
        width = block_tables.shape[1]
        if padded_reqs > r:
            # Padding requests: one query row each, a context of one token in block 0.
            last = int(query_start_loc[-1])
            query_start_loc = np.concatenate(
                [query_start_loc, last + np.arange(1, padded_reqs - r + 1, dtype=np.int32)]
            )
            seq_lens = np.concatenate([seq_lens, np.ones(padded_reqs - r, np.int32)])
            block_tables = np.concatenate([block_tables, np.zeros((padded_reqs - r, width), np.int32)])
        m = len(seq_lens)
        qsl = self._stage(self.query_start_loc_host, self.query_start_loc, query_start_loc, m + 1)
        sl = self._stage(self.seq_lens_host, self.seq_lens, seq_lens, m)
        bt = self._stage(self.block_tables_host, self.block_tables, block_tables.reshape(-1), m * width)
        return qsl, sl, bt.view(m, width)

    def stage_kv_group(
        self,
        group: int,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        padded_tokens: int,
        padded_reqs: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV cache group `group` (>= 1)'s block tables and slot mapping, padded as stage_tokens and
        stage_requests pad group 0's; returns (block_tables [padded_reqs, width], slot_mapping)."""
        n, r = len(slot_mapping), block_tables.shape[0]
        width = block_tables.shape[1]
        if padded_tokens > n:
            slot_mapping = np.concatenate([slot_mapping, np.full(padded_tokens - n, -1, np.int64)])
        if padded_reqs > r:
            block_tables = np.concatenate([block_tables, np.zeros((padded_reqs - r, width), np.int32)])
        i = group - 1
        slots = self._stage(
            self.group_slot_mapping_host[i], self.group_slot_mapping[i], slot_mapping, len(slot_mapping)
        )
        m = block_tables.shape[0]
        tables = self._stage(
            self.group_block_tables_host[i], self.group_block_tables[i], block_tables.reshape(-1), m * width
        )
        return tables.view(m, width), slots

    def stage_sample_rows(self, rows: np.ndarray) -> torch.Tensor:
        return self._stage(self.sample_rows_host, self.sample_rows, rows, len(rows))

    def stage_gather(self, src_rows: np.ndarray, dst_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(src_rows)
        return (
            self._stage(self.gather_src_host, self.gather_src, src_rows, n),
            self._stage(self.gather_dst_host, self.gather_dst, dst_rows, n),
        )
