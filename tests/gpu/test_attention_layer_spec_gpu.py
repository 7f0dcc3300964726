"""TritonPagedBackend on a CUDA GPU with layers' sliding windows, logit soft caps and sinks, at
real head dims (128; 256 as Gemma 2/3), against a dense fp32 per-request softmax over the whole
context: mixed prefill + decode batches whose chunks cross the window's edge, split-KV decodes
at long contexts, the fused RoPE decode launch, and a CUDA graph captured at short contexts and
replayed at long ones. Block-table entries before each request's window point at a block of
NaN keys and infinite values (freed blocks get reused): nothing may read them.

tests/unit/test_attention_layer_spec.py checks the same semantics on the CPU at tiny shapes.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec, AttentionMetadata

if torch.cuda.is_available():
    # Compile mode for this process: triton must be imported before the CPU tests in tests/unit
    # switch on TRITON_INTERPRET (they then rerun themselves in a subprocess).
    import triton  # noqa: F401

    from tokenmill.attention.triton_paged import TritonPagedBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

BLOCK = 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class Batch:
    """Random q/k/v and a paged cache with scattered blocks; `meta` reads the blocks through
    tables whose entries before each request's window name the poison block, `clean_tables`
    through the request's own blocks (the reference reads those)."""

    def __init__(
        self,
        query_lens: list[int],
        context_lens: list[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        window: int | None,
        *,
        device: str = "cuda",
        block_size: int = BLOCK,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_req) + 8
        order = torch.randperm(num_blocks, generator=gen)
        self.poison_block = int(order[-1])
        clean = torch.zeros(len(seq_lens), max(blocks_per_req) + 2, dtype=torch.int32)
        slots = []
        used = 0
        for r, (n_blocks, ctx, q_len) in enumerate(zip(blocks_per_req, context_lens, query_lens, strict=True)):
            owned = order[used : used + n_blocks]
            used += n_blocks
            clean[r, :n_blocks] = owned.to(torch.int32)
            positions = torch.arange(ctx, ctx + q_len)
            slots.append(owned[positions // block_size] * block_size + positions % block_size)
        poisoned = clean.clone()
        if window is not None:
            for r, ctx in enumerate(context_lens):
                poisoned[r, : max(0, ctx - window + 1) // block_size] = self.poison_block
        num_tokens = sum(query_lens)
        self.q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
        self.k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
        self.v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
        self.kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
        self.kv_cache[0, self.poison_block] = float("nan")
        self.kv_cache[1, self.poison_block] = float("inf")
        self.clean_tables = clean
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=len(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=starts.to(device),
            seq_lens=seq_lens_t.to(device),
            block_tables=poisoned.to(device),
            slot_mapping=torch.cat(slots).to(device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens_t,
            is_decode_only=max(query_lens) == 1,
        )


def make_spec(heads: int, window: int | None, soft_cap: float | None, sinks: bool, device: str = "cuda"):
    gen = torch.Generator().manual_seed(heads)
    sink_logits = (2 * torch.randn(heads, generator=gen)).to(device) if sinks else None
    return AttentionLayerSpec(sliding_window=window, logits_soft_cap=soft_cap, sinks=sink_logits)


def dense_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: Batch, spec: AttentionLayerSpec, scale: float
) -> torch.Tensor:
    """fp32 per request through the clean tables over every position (the cache must already
    hold this step's K/V): scores, soft cap, causal + window mask, softmax over [scores, sink]."""
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = batch.meta.query_start_loc_cpu.tolist()
    for r in range(batch.meta.num_reqs):
        start, end, seq_len = starts[r], starts[r + 1], int(batch.meta.seq_lens_cpu[r])
        positions = torch.arange(seq_len)
        slots = batch.clean_tables[r, positions // block_size].long() * block_size + positions % block_size
        slots = slots.to(q.device)
        keys = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        values = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        query_pos = (seq_len - (end - start) + torch.arange(end - start, device=q.device))[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if spec.sliding_window is not None:
            visible &= key_pos > query_pos - spec.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if spec.sinks is not None:
            sink = spec.sinks.float()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the kernel output"
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def check_mixed_batch(
    heads, kv_heads, head_dim, dtype, query_lens, context_lens, window, soft_cap, sinks,
    num_kv_splits=None, device="cuda",
) -> None:  # fmt: skip
    """The backend's output for a batch, against the dense reference (poisoned tables)."""
    batch = Batch(query_lens, context_lens, heads, kv_heads, head_dim, dtype, window, device=device)
    spec = make_spec(heads, window, soft_cap, sinks, device)
    scale = head_dim**-0.5
    backend = TritonPagedBackend(heads, kv_heads, head_dim, scale, BLOCK, num_kv_splits=num_kv_splits)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, cache, batch.meta, layer=spec)
    expected = dense_reference(batch.q, cache, batch, spec, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


# Chunks crossing the window's edge next to decodes at long and short contexts.
MIXED_QUERY_LENS = [1, 512, 1, 300, 1, 77]
MIXED_CONTEXT_LENS = [3000, 700, 9, 0, 1500, 4100]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        (32, 8, 128, torch.bfloat16),
        (32, 8, 128, torch.float32),
        (16, 8, 256, torch.bfloat16),  # Gemma-2-9B's attention shape
        (8, 4, 256, torch.float32),
        (64, 8, 64, torch.bfloat16),  # gpt-oss's attention shape
    ],
)
@pytest.mark.parametrize(
    ("window", "soft_cap", "sinks"),
    [
        (512, None, False),  # a window alone (Mistral-like)
        (4096, 50.0, False),  # Gemma 2's local layers: window 4096, soft cap 50
        (None, 5.0, False),  # a soft cap that bites on randn scores
        (128, None, True),  # gpt-oss's sliding layers: window 128 with sinks
        (None, None, True),  # gpt-oss's full layers: sinks alone
        (300, 5.0, True),  # all three
    ],
)
def test_mixed_batch_matches_dense(heads, kv_heads, head_dim, dtype, window, soft_cap, sinks) -> None:
    check_mixed_batch(
        heads, kv_heads, head_dim, dtype, MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, window, soft_cap, sinks
    )


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 16])
def test_split_decodes_at_long_contexts(head_dim: int, num_kv_splits: int | None) -> None:
    """Decodes at 8K-16K contexts with a 4096 window and sinks: splits over the window only (the
    planner's count, none, or 16 forced), the sink once in the merge."""
    contexts = [16000, 8191, 4095, 4096, 100, 12345, 1, 9000]
    check_mixed_batch(
        16, 8, head_dim, torch.bfloat16, [1] * len(contexts), contexts, 4096, 50.0, True, num_kv_splits
    )


def test_poisoned_pre_window_blocks_change_nothing() -> None:
    """The same step through clean and poisoned block tables: bit for bit the same output."""
    batch = Batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 32, 8, 128, torch.bfloat16, 256)
    spec = make_spec(32, 256, 50.0, True)
    backend = TritonPagedBackend(32, 8, 128, 128**-0.5, BLOCK)
    outs = []
    for tables in (batch.clean_tables.cuda(), batch.meta.block_tables):
        meta = dataclasses.replace(batch.meta, block_tables=tables)
        outs.append(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), meta, layer=spec))
    assert not torch.equal(batch.clean_tables.cuda(), batch.meta.block_tables)
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 8])
def test_decode_with_rope_equals_rope_store_then_attention(head_dim: int, num_kv_splits: int | None) -> None:
    """The fused RoPE + KV store + attention decode launch under a window, soft cap and sinks:
    bf16 bit for bit what the separate RoPE + KV-store launch followed by forward() gives."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv
    from tokenmill.model.layers.rotary import RotaryEmbedding

    heads, kv_heads, window = 16, 8, 1000
    contexts = [0, 15, 16, 999, 1000, 1001, 4095, 7000]
    batch = Batch([1] * len(contexts), contexts, heads, kv_heads, head_dim, torch.bfloat16, window)
    spec = make_spec(heads, window, 50.0, True)
    rotary = RotaryEmbedding(head_dim, 8192, 10000.0, None, device="cuda", dtype=torch.bfloat16)
    positions = batch.meta.seq_lens.long() - 1
    qkv = torch.cat([batch.q, batch.k, batch.v], dim=1)
    qk_heads = heads + kv_heads
    backend = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, BLOCK, num_kv_splits=num_kv_splits)
    fused_cache = batch.kv_cache.clone()
    fused = backend.forward_decode_with_rope(
        qkv[:, :heads], qkv[:, heads:qk_heads], qkv[:, qk_heads:], positions, rotary.cos_cache,
        rotary.sin_cache, fused_cache, batch.meta, layer=spec,
    )  # fmt: skip
    cache, qk = batch.kv_cache.clone(), qkv[:, :qk_heads].clone()
    rope_and_store_kv(
        qk, heads, batch.v, positions, rotary.cos_cache, rotary.sin_cache, cache, batch.meta.slot_mapping
    )
    unfused = backend.forward(
        qk[:, :heads], qk[:, heads:], batch.v, cache, batch.meta, kv_already_stored=True, layer=spec
    )
    torch.testing.assert_close(fused_cache, cache, rtol=0, atol=0, equal_nan=True)  # NaN: the poison block
    assert torch.equal(fused, unfused)
    expected = dense_reference(qk[:, :heads], cache, batch, spec, head_dim**-0.5)
    assert relative_error(fused, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("spec_args", [(4096, 50.0, False), (128, None, True)], ids=["gemma2", "gpt-oss"])
def test_cuda_graph_captured_short_replayed_long(spec_args) -> None:
    """A sliding layer's decode and a plain layer's, captured in one graph at short contexts and
    replayed at long ones: each layer's split count is a python constant fixed at capture, and
    nothing is read from the host at replay."""
    heads, kv_heads, head_dim, batch_size, max_blocks = 16, 8, 256, 4, 1024
    window = spec_args[0]
    long_batch = Batch([1] * batch_size, [16000, 6000, 3000, 100], heads, kv_heads, head_dim, torch.bfloat16, window)
    short = Batch([1] * batch_size, [3, 7, 20, 1], heads, kv_heads, head_dim, torch.bfloat16, window, seed=5)
    spec = make_spec(heads, *spec_args)
    backend = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, BLOCK)
    backend.prepare_for_capture(max_num_reqs=8, max_blocks_per_req=max_blocks)
    kv_cache = long_batch.kv_cache
    static = AttentionMetadata(
        num_actual_tokens=batch_size,
        num_reqs=batch_size,
        max_query_len=1,
        max_seq_len=short.meta.max_seq_len,
        query_start_loc=short.meta.query_start_loc.clone(),
        seq_lens=short.meta.seq_lens.clone(),
        block_tables=torch.zeros(batch_size, max_blocks, dtype=torch.int32, device="cuda"),
        slot_mapping=short.meta.slot_mapping.clone(),
        query_start_loc_cpu=short.meta.query_start_loc_cpu,
        seq_lens_cpu=short.meta.seq_lens_cpu,
        is_decode_only=True,
    )
    static.block_tables[:, : short.clean_tables.shape[1]] = short.clean_tables.cuda()
    q, k, v = short.q.clone(), short.k.clone(), short.v.clone()

    def step():
        windowed = backend.forward(q, k, v, kv_cache, static, layer=spec)
        plain = backend.forward(q, k, v, kv_cache, static, kv_already_stored=True, layer=PLAIN_ATTENTION)
        return windowed, plain

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        windowed, plain = step()

    q.copy_(long_batch.q)
    k.copy_(long_batch.k)
    v.copy_(long_batch.v)
    static.seq_lens.copy_(long_batch.meta.seq_lens)
    static.slot_mapping.copy_(long_batch.meta.slot_mapping)
    # Clean tables: the plain layer reads every block (the poisoned case is tested above).
    static.block_tables.zero_()
    static.block_tables[:, : long_batch.clean_tables.shape[1]] = long_batch.clean_tables.cuda()
    backend.prepare_for_replay(long_batch.meta)
    graph.replay()
    torch.cuda.synchronize()
    scale = head_dim**-0.5
    expected = dense_reference(long_batch.q, kv_cache, long_batch, spec, scale)
    assert relative_error(windowed, expected) < TOLERANCE[torch.bfloat16]
    expected_plain = dense_reference(long_batch.q, kv_cache, long_batch, PLAIN_ATTENTION, scale)
    assert relative_error(plain, expected_plain) < TOLERANCE[torch.bfloat16]
