"""TritonPagedBackend on a CUDA GPU at real shapes, against fp32 references.

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks):
64 decodes with contexts up to 4096, a mixed prefill+decode batch, split-KV on/off, and a CUDA
graph captured at short contexts and replayed at long ones.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tokenmill.attention.backend import AttentionMetadata

if torch.cuda.is_available():
    # Compile mode for this process: triton must be imported before the CPU tests in tests/unit
    # switch on TRITON_INTERPRET (they then rerun themselves in a subprocess).
    import triton  # noqa: F401

    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.triton.paged_attention import paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK,
    spare_blocks: int = 64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v and cache, blocks scattered over the pool, metadata as the runner builds it."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 2, dtype=torch.int32)
    slot_mapping = []
    used = 0
    for r, (n_blocks, ctx, qlen) in enumerate(zip(blocks_per_req, context_lens, query_lens, strict=True)):
        owned = order[used : used + n_blocks]
        used += n_blocks
        block_tables[r, :n_blocks] = owned.to(torch.int32)
        positions = torch.arange(ctx, ctx + qlen)
        slot_mapping.append(owned[positions // block_size] * block_size + positions % block_size)
    device = torch.device("cuda")
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(device, dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
        is_decode_only=max(query_lens) == 1,
    )
    return q, k, v, kv_cache, meta


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """fp32 SDPA per request over the gathered pages (the cache must already hold this step's K/V)."""
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = meta.query_start_loc_cpu.tolist()
    block_tables = meta.block_tables.cpu()
    for r in range(meta.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], int(meta.seq_lens_cpu[r])
        positions = torch.arange(seq_len)
        slots = (block_tables[r, positions // block_size].long() * block_size + positions % block_size).cuda()
        keys = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        values = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        ).transpose(0, 1)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the kernel output"
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def run_triton(q, k, v, kv_cache, meta, **kwargs) -> torch.Tensor:
    backend = TritonPagedBackend(
        q.shape[1], kv_cache.shape[3], q.shape[2], q.shape[2] ** -0.5, kv_cache.shape[2], **kwargs
    )
    return backend.forward(q, k, v, kv_cache, meta)


def test_decode_batch_of_64_long_contexts_bf16() -> None:
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(1, 4096, (64,), generator=gen).tolist()
    contexts[0] = 4095  # one request at the full 4096 after this step
    q, k, v, kv_cache, meta = make_batch([1] * 64, contexts, torch.bfloat16)
    out = run_triton(q, k, v, kv_cache, meta)  # before the reference: no stale correct memory to reuse
    expected = reference_attention(q, kv_cache, meta, HEAD_DIM**-0.5)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_mixed_prefill_and_decode_batch_bf16() -> None:
    # Prefill chunks on cached prefixes, a fresh prompt, and 16 decodes in one flattened batch.
    query_lens = [512, 300, 77, 1000] + [1] * 16
    context_lens = [1024, 0, 3000, 16] + list(range(100, 4100, 250))
    q, k, v, kv_cache, meta = make_batch(query_lens, context_lens, torch.bfloat16)
    out = run_triton(q, k, v, kv_cache, meta)
    expected = reference_attention(q, kv_cache, meta, HEAD_DIM**-0.5)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        (16, 4, 64, torch.float16),
        (8, 8, 128, torch.float32),
        (16, 2, 256, torch.bfloat16),
        (12, 4, 96, torch.float16),
    ],
)
def test_other_head_shapes_and_dtypes(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    q, k, v, kv_cache, meta = make_batch(
        [200, 1, 1, 37], [50, 900, 3, 0], dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    out = run_triton(q, k, v, kv_cache, meta)
    expected = reference_attention(q, kv_cache, meta, head_dim**-0.5)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("batch", [1, 4])
def test_split_kv_matches_unsplit_at_long_context(batch: int) -> None:
    q, k, v, kv_cache, meta = make_batch([1] * batch, [8191 - 1000 * i for i in range(batch)], torch.bfloat16)
    auto_backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    assert auto_backend._num_kv_splits(meta, q.device) > 1  # the planner does split here
    auto = auto_backend.forward(q, k, v, kv_cache, meta)
    unsplit = run_triton(q, k, v, kv_cache, meta, num_kv_splits=1)
    expected = reference_attention(q, kv_cache, meta, HEAD_DIM**-0.5)
    assert relative_error(auto, expected) < TOLERANCE[torch.bfloat16]
    assert relative_error(unsplit, expected) < TOLERANCE[torch.bfloat16]
    assert relative_error(auto, unsplit) < 1e-2


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("num_kv_splits", [1, 4, 16])
def test_every_real_row_is_written(num_kv_splits: int, fused_merge: bool) -> None:
    """Split partials merged by a second launch or inside the attention launch (the last program
    of each request and KV head merges and resets its counter: repeated calls stay right)."""
    q, k, v, kv_cache, meta = make_batch([33, 1, 1], [100, 2000, 5], torch.bfloat16)
    run_triton(q, k, v, kv_cache, meta)  # stores this step's K/V
    expected = reference_attention(q, kv_cache, meta, HEAD_DIM**-0.5)
    partial_out = torch.full((meta.num_reqs, HEADS, num_kv_splits, HEAD_DIM), float("nan"), device=q.device)
    partial_lse = torch.full((meta.num_reqs, HEADS, num_kv_splits), float("nan"), device=q.device)
    counters = (
        torch.zeros(meta.num_reqs * KV_HEADS, dtype=torch.int32, device=q.device) if fused_merge else None
    )
    for _ in range(3):
        out = torch.full_like(q, float("nan"))
        paged_attention(
            out, q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, decode_only=False, scale=HEAD_DIM**-0.5,
            num_kv_splits=num_kv_splits, partial_out=partial_out, partial_lse=partial_lse,
            split_counters=counters,
        )  # fmt: skip
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
        if counters is not None:
            assert counters.eq(0).all()


def test_store_skips_padding_slots() -> None:
    q, k, v, kv_cache, meta = make_batch([5, 1], [10, 20], torch.bfloat16)
    slot_mapping = meta.slot_mapping.clone()
    slot_mapping[2] = -1
    meta.slot_mapping = slot_mapping
    before = kv_cache.clone()
    run_triton(q, k, v, kv_cache, meta)
    flat_before = before.view(2, -1, KV_HEADS, HEAD_DIM)
    flat_after = kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)
    real = slot_mapping >= 0
    assert torch.equal(flat_after[0, slot_mapping[real]], k[real])
    assert torch.equal(flat_after[1, slot_mapping[real]], v[real])
    untouched = torch.ones(flat_before.shape[1], dtype=torch.bool, device=q.device)
    untouched[slot_mapping[real]] = False
    assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])


def test_cuda_graph_captured_short_replayed_long() -> None:
    """Capture a decode step at short contexts; replay it at long ones with fresh inputs."""
    batch, max_blocks = 4, 512  # up to 8192 tokens per request
    backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    backend.prepare_for_capture(max_num_reqs=8, max_blocks_per_req=max_blocks)
    long_ctx = [8000, 6000, 3000, 100]
    q_l, k_l, v_l, kv_cache, meta_l = make_batch([1] * batch, long_ctx, torch.bfloat16, spare_blocks=8)
    q_s, k_s, v_s, _, meta_s = make_batch([1] * batch, [3, 7, 20, 1], torch.bfloat16, seed=5)
    # Static buffers the graph reads, shaped like the runner's persistent ones.
    block_tables = torch.zeros(8, max_blocks, dtype=torch.int32, device="cuda")
    static = AttentionMetadata(
        num_actual_tokens=batch,
        num_reqs=batch,
        max_query_len=1,
        max_seq_len=meta_s.max_seq_len,
        query_start_loc=meta_s.query_start_loc.clone(),
        seq_lens=meta_s.seq_lens.clone(),
        block_tables=block_tables[:batch],
        slot_mapping=meta_s.slot_mapping.clone(),
        query_start_loc_cpu=meta_s.query_start_loc_cpu,
        seq_lens_cpu=meta_s.seq_lens_cpu,
        is_decode_only=True,
    )
    static.block_tables[:, : meta_s.block_tables.shape[1]] = meta_s.block_tables
    q, k, v = q_s.clone(), k_s.clone(), v_s.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, kv_cache, static)  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv_cache, static)

    q.copy_(q_l)
    k.copy_(k_l)
    v.copy_(v_l)
    static.seq_lens.copy_(meta_l.seq_lens)
    static.slot_mapping.copy_(meta_l.slot_mapping)
    static.block_tables.zero_()
    static.block_tables[:, : meta_l.block_tables.shape[1]] = meta_l.block_tables
    backend.prepare_for_replay(meta_l)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_attention(q_l, kv_cache, meta_l, HEAD_DIM**-0.5)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_matches_torch_reference_backend() -> None:
    if importlib.util.find_spec("tokenmill.attention.torch_ref") is None:
        pytest.skip("tokenmill.attention.torch_ref is not written yet")
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    q, k, v, kv_cache, meta = make_batch(
        [300, 1, 1, 64] + [1] * 28, [700, 4000, 1, 0] + [2048] * 28, torch.bfloat16
    )
    ref_cache = kv_cache.clone()
    out = run_triton(q, k, v, kv_cache, meta)
    reference = TorchReferenceBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    ref_out = reference.forward(q, k, v, ref_cache, meta)
    assert torch.equal(kv_cache, ref_cache)
    assert relative_error(out, ref_out) < TOLERANCE[torch.bfloat16]


def _rope_tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenmill.model.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 8192, 500000.0, None, device="cuda", dtype=dtype)
    return rotary.cos_cache, rotary.sin_cache


def _fused_and_unfused(heads, kv_heads, head_dim, dtype, contexts, num_kv_splits=None):
    """forward_decode_with_rope on un-rotated q/k/v (laid out as one qkv row, as the model has
    them), and the separate RoPE + KV-store launch then forward(): outputs, caches, rotated q."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv

    q, k, v, kv_cache, meta = make_batch(
        [1] * len(contexts), contexts, dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    positions = meta.seq_lens.long() - 1
    cos, sin = _rope_tables(head_dim, dtype)
    qkv = torch.cat([q, k, v], dim=1)
    qk_heads = heads + kv_heads
    backend = TritonPagedBackend(
        heads, kv_heads, head_dim, head_dim**-0.5, BLOCK, num_kv_splits=num_kv_splits
    )
    fused_qkv, fused_cache = qkv.clone(), kv_cache.clone()
    fused = backend.forward_decode_with_rope(
        fused_qkv[:, :heads], fused_qkv[:, heads:qk_heads], fused_qkv[:, qk_heads:],
        positions, cos, sin, fused_cache, meta,
    )  # fmt: skip
    assert torch.equal(fused_qkv, qkv)
    qk = qkv[:, :qk_heads]
    rope_and_store_kv(qk, heads, qkv[:, qk_heads:], positions, cos, sin, kv_cache, meta.slot_mapping)
    unfused = backend.forward(
        qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], kv_cache, meta, kv_already_stored=True
    )
    return fused, fused_cache, unfused, kv_cache, qk[:, :heads], meta


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "num_kv_splits"),
    [
        (HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, None),  # Llama-3.1-8B, the planner's splits
        (HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, 1),
        (HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, 16),
        (16, 4, 64, torch.float16, None),
        (8, 8, 128, torch.float32, 4),
        (14, 2, 64, torch.bfloat16, 8),  # Qwen2-0.5B-like: a group of 7
        (12, 4, 96, torch.float16, None),  # head_dim padded to 128
    ],
)
def test_decode_with_rope_equals_rope_store_then_attention(heads, kv_heads, head_dim, dtype, num_kv_splits):
    gen = torch.Generator().manual_seed(heads + head_dim)
    contexts = torch.randint(1, 4096, (24,), generator=gen).tolist() + [0, 15, 16, 63, 64, 511, 4095]
    fused, fused_cache, unfused, cache, q_rotated, meta = _fused_and_unfused(
        heads, kv_heads, head_dim, dtype, contexts, num_kv_splits
    )
    if dtype == torch.bfloat16:
        # bf16 (the CUDA default) rounds by integer arithmetic: bit for bit, whatever the compiler
        # contracts into multiply-adds; the tiles and their order are the same as unfused.
        assert torch.equal(fused_cache, cache)
        assert torch.equal(fused, unfused)
    else:
        # fp16 / fp32 RoPE may differ by an ulp where the compiler forms a multiply-add.
        # (fp16: up to an ulp of a product, ~4e-3 at randn magnitudes, where the sum cancels.)
        ulp = {"rtol": 1e-3, "atol": 4e-3} if dtype == torch.float16 else {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(fused_cache, cache, **ulp)
        assert relative_error(fused, unfused) < TOLERANCE[dtype] / 10
    expected = reference_attention(q_rotated, cache, meta, head_dim**-0.5)
    assert relative_error(fused, expected) < TOLERANCE[dtype]


def test_decode_with_rope_in_a_cuda_graph_with_padding_requests() -> None:
    """Captured at short contexts with padding requests (query_len 1, seq_len 1, slot -1, as the
    runner pads), replayed at long ones: the padding writes nothing, the real rows are right."""
    batch, padded, max_blocks = 3, 8, 512
    backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    backend.prepare_for_capture(max_num_reqs=padded, max_blocks_per_req=max_blocks)
    cos, sin = _rope_tables(HEAD_DIM, torch.bfloat16)
    q_l, k_l, v_l, kv_cache, meta_l = make_batch([1] * batch, [8000, 600, 3], torch.bfloat16, spare_blocks=8)
    qkv = torch.zeros(padded, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(padded + 1, dtype=torch.int32, device="cuda")
    static = AttentionMetadata(
        num_actual_tokens=padded,
        num_reqs=padded,
        max_query_len=1,
        max_seq_len=max_blocks * BLOCK,
        query_start_loc=qsl,
        seq_lens=torch.ones(padded, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(padded, max_blocks, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.full((padded,), -1, dtype=torch.long, device="cuda"),
        query_start_loc_cpu=qsl.cpu(),
        seq_lens_cpu=torch.ones(padded, dtype=torch.int32),
        is_decode_only=True,
    )
    positions = torch.zeros(padded, dtype=torch.long, device="cuda")

    def step():
        return backend.forward_decode_with_rope(
            qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :],
            positions, cos, sin, kv_cache, static,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    qkv[:batch] = torch.cat([q_l, k_l, v_l], dim=1)
    static.seq_lens[:batch] = meta_l.seq_lens
    static.slot_mapping[:batch] = meta_l.slot_mapping
    static.block_tables[:batch, : meta_l.block_tables.shape[1]] = meta_l.block_tables
    positions[:batch] = meta_l.seq_lens.long() - 1
    before = kv_cache.clone()
    graph.replay()
    torch.cuda.synchronize()

    from tokenmill.kernels.triton.elementwise import rope_and_store_kv

    qk = qkv[:batch, : HEADS + KV_HEADS].clone()
    rope_and_store_kv(qk, HEADS, v_l, positions[:batch], cos, sin, before, meta_l.slot_mapping)
    assert torch.equal(kv_cache, before)  # this step's K/V in their slots, nothing else written
    expected = reference_attention(qk[:, :HEADS], kv_cache, meta_l, HEAD_DIM**-0.5)
    assert relative_error(out[:batch], expected) < TOLERANCE[torch.bfloat16]
