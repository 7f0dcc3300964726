"""CUDA graphs for decode-only steps: capture once per batch size, pad to the next size, replay.

Graphs are keyed by (batch size, tokens per request). Only one token per request is captured
today; a multi-token decode (verifying draft tokens) can add captures under its own key.

Decode at small batch is launch-bound: one graph replay replaces hundreds of kernel launches and
all of the Python that issues them. Inputs live in the runner's persistent buffers, so a replay
needs only the copies that fill them. Models with several KV cache groups (sliding-window layers)
capture metadata whose per-group siblings view the buffers' per-group block tables and slot
mappings, which the runner refills before each replay like group 0's.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from tqdm import tqdm

from tokenmill.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int]  # (padded batch size, tokens per request)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16)) + list(range(288, 1024 + 1, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class CudaGraphRunner:
    def __init__(
        self, model: torch.nn.Module, attn_backend, buffers, kv_caches: list[torch.Tensor], max_num_seqs: int
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.sizes = default_capture_sizes(min(max_num_seqs, buffers.max_num_reqs))
        self.tokens_per_req = 1  # the only query length captured today
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.metas: dict[GraphKey, AttentionMetadata] = {}
        self.pool = None
        self.num_replays = 0  # for tests and stats: how many steps took the graph path

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def graph_key(self, num_reqs: int, tokens_per_req: int) -> GraphKey | None:
        """The captured graph for `num_reqs` requests of `tokens_per_req` query tokens each,
        padded to the next captured batch size; None when there is none."""
        if tokens_per_req != self.tokens_per_req:
            return None
        size = self.padded_size(num_reqs)
        return None if size is None else (size, tokens_per_req)

    def _meta(self, batch_size: int) -> AttentionMetadata:
        b = self.buffers
        width = b.max_blocks_per_req
        meta = AttentionMetadata(
            num_actual_tokens=batch_size,
            num_reqs=batch_size,
            max_query_len=1,
            max_seq_len=width * self.attn_backend.block_size,
            query_start_loc=b.query_start_loc[: batch_size + 1],
            seq_lens=b.seq_lens[:batch_size],
            block_tables=b.block_tables[: batch_size * width].view(batch_size, width),
            slot_mapping=b.slot_mapping[:batch_size],
            query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(batch_size, dtype=torch.int32),
            is_decode_only=True,
        )
        if b.group_block_tables:
            meta.with_kv_groups(
                [
                    (tables[: batch_size * width].view(batch_size, width), slots[:batch_size])
                    for tables, slots in zip(b.group_block_tables, b.group_slot_mapping, strict=True)
                ]
            )
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        b = self.buffers
        # Safe inputs for capture: every row a 1-token context in block 0, writing nowhere.
        b.input_ids.zero_()
        b.positions.zero_()
        b.slot_mapping.fill_(-1)
        b.seq_lens.fill_(1)
        b.block_tables.zero_()
        for slots, tables in zip(b.group_slot_mapping, b.group_block_tables, strict=True):
            slots.fill_(-1)
            tables.zero_()
        b.query_start_loc.copy_(torch.arange(b.max_num_reqs + 1, dtype=torch.int32, device=b.device))
        self.attn_backend.prepare_for_capture(self.max_size, b.max_blocks_per_req)
        self.pool = torch.cuda.graph_pool_handle()
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph"):
            meta = self._meta(size)
            ids, pos = b.input_ids[:size], b.positions[:size]
            for _ in range(2):  # warm-up: autotuning and lazy init happen outside the capture
                self.model.compute_logits(self.model(ids, pos, self.kv_caches, meta))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.compute_logits(self.model(ids, pos, self.kv_caches, meta))
            key = (size, self.tokens_per_req)
            self.graphs[key] = graph
            self.outputs[key] = out
            self.metas[key] = meta
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (batch sizes %s..%s) in %.1f s",
            len(self.graphs),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - started,
        )

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Logits [size * tokens per request, vocab] of the graph `key` (from `graph_key`); the
        caller has staged the inputs into the buffers."""
        self.attn_backend.prepare_for_replay(self.metas[key])
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key]
