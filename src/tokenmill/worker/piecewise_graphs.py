"""Piecewise CUDA graphs: the steps the whole-step graphs cannot take, captured around attention.

Decode-only steps replay one graph each (worker/cuda_graphs.py). A step with a prefill chunk (or
more decodes than the largest captured batch) used to run eagerly, and for Llama-3.1-8B shapes
its host side (~320 kernel launches, cuBLAS and Triton dispatch, the layers' Python) took
~29 ms on an H100 against ~18 ms of device time: serving at 24 req/s spends most of its time in
such steps, so every stream's inter-token latency paid for the host.

Here the forward is captured per token count (`PIECEWISE_SIZES`, padded up) as one graph per
stretch between two attention calls: embedding + layer 0 up to its attention, then each layer's
o_proj, MLP and the next layer's norm, qkv and RoPE / KV store, then the final norm. Attention
depends on the step's requests (how many, their query lengths and contexts: the kernels' grids),
so it runs eagerly between the pieces, reading q from and writing its output to static buffers
the pieces were captured against. (The Triton backend plans those launches once a step and replays
them for the other layers: attention/triton_paged.py, kernels/triton/fast_launch.py.) Padded rows carry slot -1 (their K/V go nowhere) and are never
read back.

During capture a stand-in for the attention backend (`_AttentionSplit`) ends the piece being
captured at each attention call, records which layer's cache and options the call had, and
starts the next piece. A model opts in with `supports_piecewise_graphs` (families whose forward
has host-side logic depending on the data do not; the CUDA mixture-of-experts ops have none).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec, AttentionMetadata

logger = logging.getLogger(__name__)

# Token counts captured: fine steps where a mixed batch typically lands (a 512-token prompt beside
# tens to hundreds of decodes), coarser above. Larger steps run eagerly: their device time hides
# the host's launches (an 8,192-token step of Llama-3.1-8B shapes took 189 ms on an H100, ~28 ms
# of it (median) host launch time, in the offline trace of BENCHMARKS.md's issue 24 section).
PIECEWISE_SIZES: tuple[int, ...] = (
    *range(16, 128, 16),
    *range(128, 1024, 64),
    *range(1024, 2048 + 1, 128),
)


@dataclass(slots=True)
class _AttentionCall:
    """One attention call of the captured forward, replayed eagerly between two pieces."""

    kv_cache: torch.Tensor
    kv_group: int  # which KV cache group's metadata the layer used (0: the step's own)
    kv_already_stored: bool
    layer: AttentionLayerSpec


class _AttentionSplit:
    """Stands in for the attention backend while the forward is captured (or warmed up)."""

    def __init__(self, owner: PiecewiseGraphs) -> None:
        self.owner = owner
        self.calls: list[_AttentionCall] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.capturing = False
        self.meta: AttentionMetadata | None = None

    def supports_fused_decode_rope(self, meta: AttentionMetadata) -> bool:
        return False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_already_stored: bool = False,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        owner = self.owner
        n = q.shape[0]
        # Copied into the static buffers inside the piece, so the piece's own tensors can be freed
        # (and their pool memory reused by later pieces and sizes).
        owner.q[:n].copy_(q)
        if not kv_already_stored:
            owner.k[:n].copy_(k)
            owner.v[:n].copy_(v)
        assert self.meta is not None
        group = 0 if meta is self.meta else 1 + next(
            i for i, sibling in enumerate(self.meta.kv_group_siblings) if sibling is meta
        )
        self.calls.append(_AttentionCall(kv_cache, group, kv_already_stored, layer))
        if self.capturing:
            self.graphs[-1].capture_end()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=owner.pool)
            self.graphs.append(graph)
        return owner.out[:n]

    def __getattr__(self, name: str):  # noqa: ANN204 - anything else the model asks of its backend
        return getattr(self.owner.attn_backend, name)


@dataclass(slots=True)
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # one more than calls
    calls: list[_AttentionCall]
    hidden: torch.Tensor  # [size, hidden]: the final norm's output


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, attn_backend, buffers, kv_caches: list[torch.Tensor], max_tokens: int) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.sizes = [s for s in PIECEWISE_SIZES if s <= min(max_tokens, buffers.max_num_tokens)]
        self.captured: dict[int, _Captured] = {}
        self.pool = None
        self.num_replays = 0
        device = buffers.device
        dtype = model.embed_tokens.dtype
        largest = self.sizes[-1] if self.sizes else 0
        # The backend's head counts are this rank's (a tensor-parallel shard's), not the model's.
        heads, kv_heads, head_dim = attn_backend.num_heads, attn_backend.num_kv_heads, attn_backend.head_dim
        self.q = torch.zeros((largest, heads, head_dim), dtype=dtype, device=device)
        self.k = torch.zeros((largest, kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((largest, kv_heads, head_dim), dtype=dtype, device=device)
        self.out = torch.zeros((largest, heads, head_dim), dtype=dtype, device=device)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def _capture_meta(self, size: int) -> AttentionMetadata:
        """What the pieces read of a step's metadata: its slot mappings (the KV stores), on the
        buffers' slices. The rest only reaches attention, which runs outside the graphs."""
        b = self.buffers
        width = b.max_blocks_per_req
        meta = AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=1,
            max_query_len=size,
            max_seq_len=size,
            query_start_loc=b.query_start_loc[:2],
            seq_lens=b.seq_lens[:1],
            block_tables=b.block_tables[:width].view(1, width),
            slot_mapping=b.slot_mapping[:size],
            query_start_loc_cpu=torch.tensor([0, size], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([size], dtype=torch.int32),
            is_decode_only=False,
        )
        if b.group_block_tables:
            meta.with_kv_groups(
                [
                    (tables[:width].view(1, width), slots[:size])
                    for tables, slots in zip(b.group_block_tables, b.group_slot_mapping, strict=True)
                ]
            )
        return meta

    def _swap_backend(self, replacement) -> list[tuple[torch.nn.Module, object]]:
        swapped = []
        for module in self.model.modules():
            if getattr(module, "attn_backend", None) is self.attn_backend:
                swapped.append((module, module.attn_backend))
                module.attn_backend = replacement
        return swapped

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.sizes:
            return
        started = time.perf_counter()
        b = self.buffers
        b.input_ids.zero_()
        b.positions.zero_()
        b.slot_mapping.fill_(-1)  # capture writes no K/V
        for slots in b.group_slot_mapping:
            slots.fill_(-1)
        self.pool = torch.cuda.graph_pool_handle()
        split = _AttentionSplit(self)
        swapped = self._swap_backend(split)
        stream = _capture_stream(b.input_ids.device)
        try:
            for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing piecewise CUDA graphs", unit="size"):
                meta = self._capture_meta(size)
                ids, pos = b.input_ids[:size], b.positions[:size]
                split.meta = meta
                # Warm-up outside the capture (lazy initialisation, Triton compiles, cuBLAS plans).
                split.calls, split.capturing = [], False
                self.model(ids, pos, self.kv_caches, meta)
                torch.cuda.synchronize()
                split.calls, split.graphs, split.capturing = [], [torch.cuda.CUDAGraph()], True
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    split.graphs[0].capture_begin(pool=self.pool)
                    try:
                        hidden = self.model(ids, pos, self.kv_caches, meta)
                    finally:
                        split.graphs[-1].capture_end()
                torch.cuda.current_stream().wait_stream(stream)
                self.captured[size] = _Captured(split.graphs, split.calls, hidden)
        finally:
            for module, backend in swapped:
                module.attn_backend = backend
        torch.cuda.synchronize()
        pieces = sum(len(c.graphs) for c in self.captured.values())
        logger.info(
            "captured piecewise CUDA graphs for %d step sizes (%d..%d tokens, %d pieces) in %.1f s",
            len(self.captured), self.sizes[0], self.sizes[-1], pieces, time.perf_counter() - started,
        )  # fmt: skip

    def run(self, size: int, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states [size, hidden] of a step of `num_tokens` tokens whose
        inputs are staged in the buffers, padded to `size` (from `padded_size`); attention runs
        eagerly on the first `num_tokens` rows with the step's own `meta`."""
        captured = self.captured[size]
        backend = self.attn_backend
        q, k, v, out = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens], self.out[:num_tokens]
        graphs = captured.graphs
        # A KV connector's per-layer hooks: piece i holds layer i's KV store, so layer i's copies
        # are waited for before it (the calls were recorded one per layer, in layer order).
        hooks = meta.kv_layer_hooks
        for layer_index, (graph, call) in enumerate(zip(graphs, captured.calls, strict=False)):
            if hooks is not None:
                hooks.wait_for_layer_load(layer_index)
            graph.replay()
            group_meta = meta if call.kv_group == 0 else meta.kv_group_siblings[call.kv_group - 1]
            result = backend.forward(
                q, k, v, call.kv_cache, group_meta, kv_already_stored=call.kv_already_stored, layer=call.layer
            )
            out.copy_(result)
            if hooks is not None:
                hooks.save_kv_layer(layer_index)
        graphs[-1].replay()
        self.num_replays += 1
        return captured.hidden


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every engine's captures, as torch.cuda.graph keeps one: torch
    keeps a cuBLAS workspace per stream that ran a matmul for the life of the process (64 MiB on
    an H200), so a new stream per engine left one behind for every LLM made and closed."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
