"""CUDA graphs for decode steps: capture once per batch size, pad to the next size, replay.

Graphs are keyed by (batch size, tokens per request). One token per request is always captured;
`spec_tokens_per_request` adds uniform multi-token decode steps (speculative verification: every
request computes its last token and k draft tokens, q = 1 + k query tokens at decode positions),
keyed (padded batch size, q). Their attention runs as a multi-token decode (the metadata's
multi_token_decode): one read of each KV tile for all q tokens of a request.

Decode at small batch is launch-bound: one graph replay replaces hundreds of kernel launches and
all of the Python that issues them. Inputs live in the runner's persistent buffers, so a replay
needs only the copies that fill them. Models with several KV cache groups (sliding-window layers)
capture metadata whose per-group siblings view the buffers' per-group block tables and slot
mappings, which the runner refills before each replay like group 0's.

Padding: a padded batch's extra requests carry slot -1 for every row (their K/V are written
nowhere) and a context in block 0; their rows are never read back. A q > 1 graph reads its
query_start_loc from a constant tensor (0, q, 2q, ...), not from the staged buffer: the staged
one pads with one row per padding request, as a q = 1 step has.

EAGLE-3 (`aux_layers`): the graphs run the target's `forward_with_aux_hidden_states` and keep the
aux hidden states [size * q, 3 * hidden] as a second output, which the drafter reads after the step.

Logits: a q = 1 graph's output is the logits [size, vocab] (captured). A q > 1 graph captures the
model's hidden states [size * q, hidden] only, and the replay computes the logits of the real rows
eagerly: captured logits would hold float32 [size * q, vocab] per graph (for Llama-3.1-8B and batch
sizes up to 256 at q = 8, about 9 GB), and the lm_head then skips the padding rows.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from tokenmill.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int]  # (padded batch size, tokens per request)


# The longest uniform multi-token decode captured (1 + k draft tokens, k <= 7): the attention
# kernel's decode launch serves up to this many query tokens per request.
MAX_TOKENS_PER_REQUEST = 8


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """No garbage collection while graphs are captured: collecting an unreachable CUDA graph (an
    earlier engine's in the same process) resets it mid-capture, which CUDA forbids, and the capture
    in progress is invalidated. Whatever is garbage is collected just before."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16)) + list(range(288, 1024 + 1, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def capture_sizes_by_tokens_per_request(
    max_num_seqs: int, max_num_tokens: int, spec_tokens_per_request: tuple[int, ...] = (1,)
) -> dict[int, list[int]]:
    """The batch sizes captured for each query length q: the default sizes whose size * q token
    rows fit the input buffers (q = 1 always, at every default size)."""
    for q in spec_tokens_per_request:
        if not 1 <= q <= MAX_TOKENS_PER_REQUEST:
            raise ValueError(
                f"spec_tokens_per_request holds {q}; each must be 1 + k with 0 <= k <= "
                f"{MAX_TOKENS_PER_REQUEST - 1} (the query lengths a verification step computes)"
            )
    sizes = default_capture_sizes(max_num_seqs)
    by_q = {1: sizes}
    for q in sorted(set(spec_tokens_per_request) - {1}):
        fitting = [s for s in sizes if s * q <= max_num_tokens]
        if fitting:
            by_q[q] = fitting
    return by_q


def padded_graph_key(sizes_by_q: dict[int, list[int]], num_reqs: int, tokens_per_req: int) -> GraphKey | None:
    """(the captured batch size `num_reqs` pads to, tokens_per_req), or None when no graph takes it."""
    sizes = sizes_by_q.get(tokens_per_req)
    if not sizes:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return (sizes[i], tokens_per_req) if i < len(sizes) else None




class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        buffers,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        spec_tokens_per_request: tuple[int, ...] = (1,),
        aux_layers: tuple[int, ...] | None = None,
    ) -> None:
        """`spec_tokens_per_request`: the query lengths to capture, 1 and the verification steps'
        1 + k (e.g. (1, 4) for 3 draft tokens); the default captures single-token decodes only.
        `aux_layers`: also capture the aux hidden states entering these layers (EAGLE-3)."""
        self.model = model
        self.aux_layers = aux_layers
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.sizes_by_q = capture_sizes_by_tokens_per_request(
            min(max_num_seqs, buffers.max_num_reqs), buffers.max_num_tokens, spec_tokens_per_request
        )
        self.sizes = self.sizes_by_q[1]
        self.spec_tokens_per_request = tuple(sorted(self.sizes_by_q))
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # q = 1: logits; q > 1: hidden states
        self.aux_outputs: dict[GraphKey, torch.Tensor] = {}  # with aux_layers: [size * q, 3 * hidden]
        self.metas: dict[GraphKey, AttentionMetadata] = {}
        self._uniform_query_start: dict[int, torch.Tensor] = {}  # q -> 0, q, 2q, ... (never written)
        self.pool = None
        self.num_replays = 0  # for tests and stats: how many steps took the graph path
        self.capture_stats: dict[int, dict[str, float]] = {}  # q -> graphs, seconds, GiB (capture's)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def graph_key(self, num_reqs: int, tokens_per_req: int) -> GraphKey | None:
        """The captured graph for `num_reqs` requests of `tokens_per_req` query tokens each,
        padded to the next captured batch size; None when there is none."""
        return padded_graph_key(self.sizes_by_q, num_reqs, tokens_per_req)

    def _meta(self, batch_size: int, q: int) -> AttentionMetadata:
        b = self.buffers
        width = b.max_blocks_per_req
        num_rows = batch_size * q
        if q == 1:
            query_start_loc = b.query_start_loc[: batch_size + 1]
        else:
            query_start_loc = self._uniform_query_start[q][: batch_size + 1]
        meta = AttentionMetadata(
            num_actual_tokens=num_rows,
            num_reqs=batch_size,
            max_query_len=q,
            max_seq_len=width * self.attn_backend.block_size,
            query_start_loc=query_start_loc,
            seq_lens=b.seq_lens[:batch_size],
            block_tables=b.block_tables[: batch_size * width].view(batch_size, width),
            slot_mapping=b.slot_mapping[:num_rows],
            query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32) * q,
            seq_lens_cpu=torch.full((batch_size,), q, dtype=torch.int32),
            is_decode_only=q == 1,
            multi_token_decode=q > 1,
        )
        if b.group_block_tables:
            meta.with_kv_groups(
                [
                    (tables[: batch_size * width].view(batch_size, width), slots[:num_rows])
                    for tables, slots in zip(b.group_block_tables, b.group_slot_mapping, strict=True)
                ]
            )
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        b = self.buffers
        # Safe inputs for capture: every row in block 0 of a q-token context, writing nowhere.
        b.input_ids.zero_()
        b.positions.zero_()
        b.slot_mapping.fill_(-1)
        b.block_tables.zero_()
        for slots, tables in zip(b.group_slot_mapping, b.group_block_tables, strict=True):
            slots.fill_(-1)
            tables.zero_()
        b.query_start_loc.copy_(torch.arange(b.max_num_reqs + 1, dtype=torch.int32, device=b.device))
        max_q = max(self.sizes_by_q)
        self.attn_backend.prepare_for_capture(self.max_size, b.max_blocks_per_req, max_decode_query_len=max_q)
        self.pool = torch.cuda.graph_pool_handle()
        for q, sizes in sorted(self.sizes_by_q.items()):
            started = time.perf_counter()
            free_before = torch.cuda.mem_get_info()[0]
            b.seq_lens.fill_(q)
            if q > 1:
                self._uniform_query_start[q] = q * torch.arange(
                    sizes[-1] + 1, dtype=torch.int32, device=b.device
                )
            desc = "Capturing CUDA graphs" + ("" if q == 1 else f" ({q} tokens per request)")
            for size in tqdm(sorted(sizes, reverse=True), desc=desc, unit="graph"):
                self._capture_one(size, q)
            torch.cuda.synchronize()
            stats = {
                "graphs": len(sizes),
                "seconds": time.perf_counter() - started,
                "gib": (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
            }
            self.capture_stats[q] = stats
            logger.info(
                "captured %d CUDA graphs of %d token(s) per request (batch sizes %s..%s) in %.1f s, %.2f GiB",
                stats["graphs"], q, sizes[0], sizes[-1], stats["seconds"], stats["gib"],
            )  # fmt: skip

    def _capture_one(self, size: int, q: int) -> None:
        b = self.buffers
        meta = self._meta(size, q)
        ids, pos = b.input_ids[: size * q], b.positions[: size * q]

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            aux = None
            if self.aux_layers is None:
                hidden = self.model(ids, pos, self.kv_caches, meta)
            else:
                hidden, aux = self.model.forward_with_aux_hidden_states(
                    ids, pos, self.kv_caches, meta, self.aux_layers
                )
            return (self.model.compute_logits(hidden) if q == 1 else hidden), aux

        for _ in range(2):  # warm-up: autotuning and lazy init happen outside the capture
            forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out, aux = forward()
        key = (size, q)
        self.graphs[key] = graph
        self.outputs[key] = out
        if aux is not None:
            self.aux_outputs[key] = aux
        self.metas[key] = meta

    def replay(self, key: GraphKey, num_rows: int | None = None) -> torch.Tensor:
        """Logits of the graph `key` (from `graph_key`) for its first `num_rows` rows (all by
        default), float32 [num_rows, vocab], in the step's row order: request i's q query tokens
        are rows i*q .. i*q + q - 1, so for q > 1 there are q rows per request. The caller has
        staged the inputs into the buffers."""
        size, q = key
        rows = size * q if num_rows is None else num_rows
        self.attn_backend.prepare_for_replay(self.metas[key])
        self.graphs[key].replay()
        self.num_replays += 1
        if q == 1:
            return self.outputs[key][:rows]
        return self.model.compute_logits(self.outputs[key][:rows])

    def aux_hidden_states(self, key: GraphKey, num_rows: int) -> torch.Tensor:
        """A copy of the aux hidden states of the last replay of `key` (graphs captured with
        `aux_layers`), its first `num_rows` rows in the step's row order. A copy (queued on the
        stream after the replay): the drafter reads it after the step's tokens are back, and a
        later step may replay the same graph before that."""
        return self.aux_outputs[key][:num_rows].clone()
