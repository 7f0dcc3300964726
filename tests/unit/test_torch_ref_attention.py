"""The CPU attention backends against a naive per-request, per-head loop: the torch reference
(gather + SDPA) and the C++ paged kernels, the latter both as configured (long query chunks go to
the reference path) and with the kernel taking every batch."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import torch_ref
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.kernels.cpu.build import cpu_kernels_available

BLOCK_SIZE = 4

_KERNELS, _WHY_NOT = cpu_kernels_available()
needs_kernels = pytest.mark.skipif(not _KERNELS, reason=f"CPU kernels unavailable: {_WHY_NOT}")


def _kernel_for_every_batch(*args):
    backend = CpuPagedBackend(*args)
    backend.max_kernel_query_len = 1 << 30
    return backend


@pytest.fixture(
    params=[
        pytest.param(TorchReferenceBackend, id="torch"),
        pytest.param(CpuPagedBackend, id="cpu", marks=needs_kernels),
        pytest.param(_kernel_for_every_batch, id="cpu-kernel-only", marks=needs_kernels),
    ]
)
def make_backend(request):
    return request.param


def _shuffled_tables(seq_lens, block_size, gen) -> tuple[list[list[int]], list[int]]:
    """Block tables for requests of `seq_lens` tokens over a shuffled pool with one spare block:
    (tables, the pool's block ids in order)."""
    blocks = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks) + 1, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    return tables, order


def _metadata(
    query_lens,
    seq_lens,
    block_tables,
    num_padding_rows=0,
    num_padding_reqs=0,
    block_size=BLOCK_SIZE,
    decode_only: bool | None = None,
) -> AttentionMetadata:
    """decode_only None: whether every query is one token."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
    slots += [-1] * num_padding_rows
    width = max(len(t) for t in block_tables)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    # CUDA-graph style padding: device tensors hold extra empty requests after the real ones.
    pad_reqs = num_padding_reqs
    padded_starts = torch.tensor(starts + [starts[-1] + num_padding_rows] * pad_reqs, dtype=torch.int32)
    padded_tables = [t + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad_reqs
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_reqs=len(query_lens) + pad_reqs,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=padded_starts,
        seq_lens=torch.cat([seq_lens_t, torch.zeros(pad_reqs, dtype=torch.int32)]),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
        is_decode_only=all(n == 1 for n in query_lens) if decode_only is None else decode_only,
    )


def _naive(q, k_hist, v_hist, query_lens, seq_lens, scale, num_heads, num_kv_heads):
    """Per request, per head, float64: query j at position seq_len - query_len + j sees keys <= it."""
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_heads, q.shape[-1], dtype=torch.float64)
    row = 0
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for j in range(q_len):
            pos = s_len - q_len + j
            for h in range(num_heads):
                keys = k_hist[r][: pos + 1, h // group].double()
                vals = v_hist[r][: pos + 1, h // group].double()
                probs = torch.softmax(keys @ q[row + j, h].double() * scale, dim=0)
                out[row + j, h] = probs @ vals
        row += q_len
    return out


def _run_case(
    query_lens,
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    seed=0,
    num_padding_rows=0,
    num_padding_reqs=0,
    make_backend=TorchReferenceBackend,
):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, shuffled block tables
    tables = []
    for n in blocks_needed:
        tables.append(free[:n])
        free = free[n:]

    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    # Full K/V history per request; the context part is already in the cache, the rest is this step's.
    k_hist = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    v_hist = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    for r, s_len in enumerate(seq_lens):
        for p in range(s_len - query_lens[r]):
            block, offset = tables[r][p // BLOCK_SIZE], p % BLOCK_SIZE
            cache[0, block, offset], cache[1, block, offset] = k_hist[r][p], v_hist[r][p]
    k_new = torch.cat([k_hist[r][s - q :] for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))])
    v_new = torch.cat([v_hist[r][s - q :] for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))])
    num_tokens = k_new.shape[0]
    pad = num_padding_rows
    q = torch.randn(num_tokens + pad, num_heads, head_dim, generator=gen)
    k = torch.cat([k_new, torch.randn(pad, num_kv_heads, head_dim, generator=gen)])
    v = torch.cat([v_new, torch.randn(pad, num_kv_heads, head_dim, generator=gen)])

    meta = _metadata(query_lens, seq_lens, tables, num_padding_rows=pad, num_padding_reqs=num_padding_reqs)
    scale = head_dim**-0.5
    backend = make_backend(num_heads, num_kv_heads, head_dim, scale, BLOCK_SIZE)
    before = cache.clone()
    out = backend.forward(q, k, v, cache, meta)

    expected = _naive(q, k_hist, v_hist, query_lens, seq_lens, scale, num_heads, num_kv_heads)
    assert out.shape == (num_tokens + pad, num_heads, head_dim)
    torch.testing.assert_close(out[:num_tokens].double(), expected[:num_tokens], atol=1e-5, rtol=1e-5)

    # This step's K/V landed at their slots; nothing else changed (padding rows wrote nowhere).
    expected_cache = before.clone()
    flat = expected_cache.view(2, -1, num_kv_heads, head_dim)
    slots = meta.slot_mapping[:num_tokens]
    flat[0, slots], flat[1, slots] = k_new, v_new
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4), (8, 1)])
def test_mixed_prefill_and_decode(num_heads, num_kv_heads, head_dim, make_backend):
    # decodes, a fresh prefill, prefill chunks with cached context, a one-token prompt
    _run_case(
        [1, 5, 3, 1, 6, 1], [7, 5, 14, 1, 17, 9], num_heads, num_kv_heads, head_dim, make_backend=make_backend
    )


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 2 * 8 * BLOCK_SIZE * 2 * 64 * 4])
def test_requests_in_chunks_give_the_same_result(monkeypatch, chunk_bytes):
    # CPU gathers K/V a few requests at a time (1 byte: one request per chunk; else 3 per chunk)
    monkeypatch.setattr(torch_ref, "_CPU_CHUNK_BYTES", chunk_bytes)
    _run_case([1, 5, 3, 1, 6, 1, 2], [7, 5, 14, 1, 17, 9, 30], 4, 2, 64, seed=9)
    _run_case([1] * 7, [7, 5, 14, 1, 17, 9, 30], 4, 2, 64, seed=10)


def test_decode_only_batch(make_backend):
    _run_case([1] * 9, [1, 2, 3, 4, 5, 8, 9, 16, 33], 4, 2, 64, seed=1, make_backend=make_backend)


def test_single_long_prefill(make_backend):
    _run_case([37], [37], 4, 2, 64, seed=2, make_backend=make_backend)


def test_padding_rows_write_nowhere(make_backend):
    _run_case([2, 1, 4], [6, 3, 4], 4, 2, 64, seed=3, num_padding_rows=3, make_backend=make_backend)


def test_padding_requests_on_device_are_ignored(make_backend):
    # host copies describe the real requests; device tensors carry empty padding requests after them
    _run_case(
        [1, 1, 1],
        [6, 3, 9],
        4,
        2,
        64,
        seed=8,
        num_padding_rows=5,
        num_padding_reqs=5,
        make_backend=make_backend,
    )


def test_long_prefill_next_to_decodes_splits_the_batch(make_backend):
    # 12 decodes + one 40-token prefill: padding everything to 40 rows would be wasteful, so the
    # backend groups decodes and prefills; results must not change.
    _run_case([1] * 12 + [40], [5 + i for i in range(12)] + [45], 4, 2, 64, seed=4, make_backend=make_backend)


def test_very_uneven_prefills_go_one_by_one(make_backend):
    _run_case([40, 2, 3, 1], [40, 10, 3, 7], 8, 2, 64, seed=5, make_backend=make_backend)


def test_decodes_next_to_uneven_long_prefills(make_backend):
    # the cpu backend: decodes and short chunks on the kernel, the long chunks (one by one here,
    # they are too uneven to pad together) on the reference path, rows placed back in order
    _run_case(
        [1, 17, 1, 3, 17, 100, 1], [9, 17, 30, 8, 40, 100, 2], 4, 2, 64, seed=12, make_backend=make_backend
    )


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_kernel_long_contexts_and_many_requests(head_dim):
    # contexts over many blocks (the online softmax rescales across blocks), query chunks that
    # span several 16-token tiles, and enough requests that both threads get work
    query_lens = [1] * 20 + [16, 17, 33]
    seq_lens = [3 + 7 * i for i in range(20)] + [16, 60, 97]
    _run_case(query_lens, seq_lens, 8, 2, head_dim, seed=11, make_backend=_kernel_for_every_batch)


def test_bfloat16_cache_is_close(make_backend):
    # softmax runs in float32 whatever the dtype; compare against the float32 result
    gen = torch.Generator().manual_seed(6)
    query_lens, seq_lens = [3, 1], [3, 6]
    tables = [[2], [0, 1]]
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    cache = torch.randn(2, 3, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(4, num_heads, head_dim, generator=gen)
    k = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    backend = make_backend(num_heads, num_kv_heads, head_dim, head_dim**-0.5, BLOCK_SIZE)
    out32 = backend.forward(q, k, v, cache.clone(), _metadata(query_lens, seq_lens, tables))
    bf = torch.bfloat16
    out16 = backend.forward(
        q.to(bf), k.to(bf), v.to(bf), cache.to(bf), _metadata(query_lens, seq_lens, tables)
    )
    assert out16.dtype == bf
    torch.testing.assert_close(out16.float(), out32, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("slots", [[-1, 5, -1, 7, -1], [-1, -1], [3, 9]])
def test_kv_store_skips_minus_one_slots(slots):
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 3, BLOCK_SIZE, 2, 8, generator=gen)
    k = torch.randn(len(slots), 2, 8, generator=gen)
    v = torch.randn(len(slots), 2, 8, generator=gen)
    expected = cache.clone()
    flat = expected.view(2, -1, 2, 8)
    for row, slot in enumerate(slots):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[row], v[row]
    backend = TorchReferenceBackend(4, 2, 8, 1.0, BLOCK_SIZE)
    backend._store_kv(k, v, cache, torch.tensor(slots))
    assert torch.equal(cache, expected)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slots", [[-1, 5, -1, 7, -1], [-1, -1], [3, 9]])
def test_cpu_kernel_kv_store_skips_minus_one_slots(slots, cache_dtype):
    """float32 rows go into a 16-bit cache converted by the kernel, rounded as Tensor.to rounds
    (bit for bit, over values from fp16 subnormals to past bf16's and fp16's mantissas)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 3, BLOCK_SIZE, 2, 8, generator=gen).to(cache_dtype)
    magnitudes = torch.tensor([1e-7, 3e-5, 1.0, 37.3, 6.1e4, 1e-3, 0.1, 250.0])
    k = torch.randn(len(slots), 2, 8, generator=gen) * magnitudes
    v = torch.randn(len(slots), 2, 8, generator=gen) * magnitudes.flip(0)
    expected = cache.clone()
    flat = expected.view(2, -1, 2, 8)
    for row, slot in enumerate(slots):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[row].to(cache_dtype), v[row].to(cache_dtype)
    torch.ops.tokenmill_cpu.store_kv(cache, k, v, torch.tensor(slots))
    assert torch.equal(cache.view(torch.int16 if cache_dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if cache_dtype != torch.float32 else torch.int32))
    CpuPagedBackend.store_kv(k, v, cache, torch.tensor(slots))  # the backend's entry: the same
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="share the cache's dtype"):
        torch.ops.tokenmill_cpu.store_kv(cache, k.double(), v.double(), torch.tensor(slots))


@needs_kernels
def test_cpu_kernel_rejects_a_slot_outside_the_cache():
    cache = torch.zeros(2, 3, BLOCK_SIZE, 2, 8)
    k = v = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuPagedBackend.store_kv(k, v, cache, torch.tensor([3 * BLOCK_SIZE]))
    assert not cache.any()


def test_auto_falls_back_to_the_reference_when_the_kernels_cannot_build(monkeypatch, caplog):
    from tokenmill.attention import backend
    from tokenmill.kernels.cpu import build as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "cpu_kernels_available", lambda: (False, "no compiler here"))
    with caplog.at_level("WARNING"):
        chosen = backend.get_attention_backend("auto", torch.device("cpu"))
    assert chosen is TorchReferenceBackend
    assert "no compiler here" in caplog.text


def test_unknown_attention_backend_names_the_choices():
    from tokenmill.attention import backend

    with pytest.raises(ValueError, match="auto, torch, cpu, triton"):
        backend.get_attention_backend("flash", torch.device("cpu"))


@needs_kernels
@pytest.mark.parametrize("seed", range(6))
def test_cpu_kernel_random_batches_match_the_reference(seed):
    # Random shapes the fixed cases miss: block sizes 1-32, head_dims off the vector fast paths
    # (80: no 64-wide value chunks; 36: not a multiple of 8), GQA groups 1-8, query chunks around
    # the 16-token tile, float32 and bfloat16.
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16, 32])
    head_dim = rng.choice([36, 64, 80, 128])
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 3, 8])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    query_lens = [rng.choice([1, 1, 2, 15, 16, 17, 33]) for _ in range(rng.randint(1, 9))]
    seq_lens = [q + rng.randint(0, 70) for q in query_lens]
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    order = list(range(sum(blocks) + 2))
    rng.shuffle(order)
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    meta = _metadata(query_lens, seq_lens, tables, block_size=block_size)
    starts = meta.query_start_loc_cpu.tolist()
    cache = torch.randn(2, len(order), block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(starts[-1], num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(starts[-1], num_kv_heads, head_dim, generator=gen).to(dtype)
    args = (num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size)
    cache_ref, cache_cpu = cache.clone(), cache.clone()
    expected = TorchReferenceBackend(*args).forward(q, k, v, cache_ref, meta)
    got = _kernel_for_every_batch(*args).forward(q, k, v, cache_cpu, meta)
    assert torch.equal(cache_cpu, cache_ref)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 36])
def test_cpu_kernel_float32_queries_over_a_16_bit_cache(cache_dtype, head_dim):
    # A float32 model over a float16 / bfloat16 cache: q and the output stay float32 and the kernel
    # converts the cache's rows as it reads them (the decode fast path at head_dim 64, the general
    # path for longer queries and head_dim 36). Against the reference over the same values held in
    # float32 (k and v rounded to the cache's dtype first, as storing them does), so the only
    # difference left is float32 summation order.
    gen = torch.Generator().manual_seed(5)
    query_lens, seq_lens = [1, 1, 1, 5, 17], [1, 40, 71, 9, 30]
    block_size, num_heads, num_kv_heads = 16, 9, 3
    tables, order = _shuffled_tables(seq_lens, block_size, gen)
    meta = _metadata(query_lens, seq_lens, tables, block_size=block_size, decode_only=False)
    starts = meta.query_start_loc_cpu.tolist()
    cache16 = torch.randn(2, len(order), block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    k = torch.randn(starts[-1], num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
    v = torch.randn(starts[-1], num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
    args = (num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size)
    cache32 = cache16.float()
    expected = TorchReferenceBackend(*args).forward(q, k, v, cache32, meta)
    got = _kernel_for_every_batch(*args).forward(q, k, v, cache16, meta)
    assert got.dtype == torch.float32
    assert torch.equal(cache16.float(), cache32)  # the same rows stored
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cpu_backend_takes_long_chunks_over_short_contexts_on_the_kernel(cache_dtype):
    """Prefill chunks longer than the kernel's query tile go to the kernel while every such chunk's
    context is short (max_kernel_prefill_context), to the reference's gather + SDPA once one is
    long; the rows equal the reference's over the same stored values either way."""
    gen = torch.Generator().manual_seed(12)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    args = (num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size)

    def run(query_lens, seq_lens):
        tables, order = _shuffled_tables(seq_lens, block_size, gen)
        meta = _metadata(query_lens, seq_lens, tables, block_size=block_size, decode_only=False)
        rows = meta.query_start_loc_cpu.tolist()[-1]
        cache = torch.randn(2, len(order), block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        q = torch.randn(rows, num_heads, head_dim, generator=gen)
        k = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
        backend = CpuPagedBackend(*args)
        calls = []
        for name in ("forward", "attend_requests"):
            original = getattr(backend._reference, name)
            setattr(backend._reference, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
        got = backend.forward(q, k, v, cache.clone(), meta)
        expected = TorchReferenceBackend(*args).forward(
            q, k.to(cache_dtype).float(), v.to(cache_dtype).float(), cache.float(), meta
        )
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        return calls

    limit = CpuPagedBackend(*args).max_kernel_prefill_context
    assert run([40, 1, 33, 1], [40, 70, limit, 9]) == []  # long chunks, short contexts: the kernel alone
    assert run([40, 33], [40, 33 + 20]) == []
    assert run([40, 1, 33], [40, 70, limit + 1]) == ["attend_requests"]  # one long context: its step's long chunks
    assert set(run([40, 33], [40, limit + 50])) == {"forward"}  # all prefill, one long context


@needs_kernels
def test_cpu_kernel_refuses_a_block_id_outside_the_cache():
    meta = _metadata([1], [3], [[0]])
    meta.block_tables[0, 0] = 7  # the cache below has 2 blocks
    cache = torch.zeros(2, 2, BLOCK_SIZE, 2, 8)
    backend = CpuPagedBackend(4, 2, 8, 1.0, BLOCK_SIZE)
    with pytest.raises(RuntimeError, match="not a block of this cache"):
        backend.forward(torch.ones(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), cache, meta)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    # torch's extension builder waits forever on a lock left by a process killed mid-build
    import os
    import time

    from tokenmill.kernels.cpu.build import clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build may be running right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # nothing to remove


def test_a_fresh_lock_of_a_killed_build_is_waited_out_not_forever(tmp_path):
    # A process killed mid-build leaves a fresh lock; an engine starting right then waits until
    # the lock is stale instead of torch's endless wait.
    import time

    from tokenmill.kernels.cpu.build import wait_for_build_lock

    lock = tmp_path / "lock"
    lock.touch()
    start = time.monotonic()
    wait_for_build_lock(tmp_path, max_age_s=0.3, poll_s=0.05)
    assert not lock.exists() and 0.2 < time.monotonic() - start < 5
    wait_for_build_lock(tmp_path, max_age_s=0.3, poll_s=0.05)  # no lock: returns at once


def test_each_checkout_builds_the_cpu_kernels_in_its_own_directory(tmp_path, monkeypatch):
    # ninja's build file records the sources' paths: two checkouts of the same sources sharing one
    # build directory rebuilt it in turn, each start waiting on the other's lock.
    import shutil

    from tokenmill.kernels.cpu import build

    here = build.build_directory()
    assert build.build_directory() == here  # stable for one checkout
    copies = []
    for source in build._SOURCES:
        copy = tmp_path / source.name
        shutil.copy(source, copy)
        copies.append(copy)
    monkeypatch.setattr(build, "_SOURCES", copies)
    assert build.build_directory() != here


@needs_kernels
def test_cpu_backend_converts_each_steps_metadata_anew():
    """The CPU backend converts a step's metadata once and reuses it for the step's other layers
    (keyed by the metadata object). One backend over two consecutive decode steps of a request
    must read the second step's lengths and slots: the same output and cache as a fresh backend."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, table = 4, 2, 32, [2, 0, 1]
    cache = torch.randn(2, 3, BLOCK_SIZE, kv_heads, dim, generator=gen)
    reused = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5, BLOCK_SIZE)
    for seq_len in (5, 6):
        q = torch.randn(1, heads, dim, generator=gen)
        k, v = torch.randn(1, kv_heads, dim, generator=gen), torch.randn(1, kv_heads, dim, generator=gen)
        meta = _metadata([1], [seq_len], [table])
        for _ in range(2):  # a second layer of the step: the cached conversion
            fresh_cache = cache.clone()
            expected = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5, BLOCK_SIZE).forward(q, k, v, fresh_cache, meta)
            out = reused.forward(q, k, v, cache, meta)
            assert torch.equal(out, expected)
            assert torch.equal(cache, fresh_cache)


@needs_kernels
def test_cpu_backend_auto_kv_cache_dtype_follows_the_kernel_config(monkeypatch):
    from tokenmill.config import KernelConfig

    def backend(**kernel):
        return CpuPagedBackend(9, 3, 64, 0.125, 16, kernel=KernelConfig(**kernel))

    assert backend().auto_kv_cache_dtype(torch.float32) == torch.float32  # default: the model's
    # ... except under a GGUF checkpoint's quantized weights (llama.cpp's default cache), unless asked
    assert backend().auto_kv_cache_dtype(torch.float32, quantized_weights=True) == torch.float16
    assert (
        backend(cpu_kv_cache_dtype="float32").auto_kv_cache_dtype(torch.float32, quantized_weights=True)
        == torch.float32
    )
    assert backend(cpu_kv_cache_dtype="float16").auto_kv_cache_dtype(torch.float32) == torch.float16
    assert backend(cpu_kv_cache_dtype="bfloat16").auto_kv_cache_dtype(torch.float32) == torch.bfloat16
    # a 16-bit model keeps its own dtype; a build without the vector decode path keeps float32
    assert backend(cpu_kv_cache_dtype="float16").auto_kv_cache_dtype(torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert backend(cpu_kv_cache_dtype="float16").auto_kv_cache_dtype(torch.float32) == torch.float32


def test_cpu_kv_cache_dtype_kernel_config_is_checked():
    from tokenmill.args import EngineArgs

    with pytest.raises(ValueError, match="cpu_kv_cache_dtype"):
        EngineArgs(kernel_config={"cpu_kv_cache_dtype": "fp8"}).create_kernel_config()
