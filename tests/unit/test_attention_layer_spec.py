"""Every attention backend honours a layer's AttentionLayerSpec: sliding window, logit soft cap and
attention sinks, alone and together, with GQA, in mixed batches of prefill chunks and decodes;
against a dense per-request float64 softmax over the whole context written here.

A sliding layer must not read the blocks that lie wholly before its window (another layer of the
KV cache frees and reuses them): the poisoned cases point those block-table entries at a block of
NaN keys and infinite values, and the output must not change by a bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec, AttentionMetadata
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.kernels.cpu.build import cpu_kernels_available

_CPU_KERNELS, _WHY_NOT = cpu_kernels_available()
needs_cpu_kernels = pytest.mark.skipif(not _CPU_KERNELS, reason=f"CPU kernels unavailable: {_WHY_NOT}")


@dataclass
class Case:
    """One step: per request, this step's query length and the tokens cached before it."""

    query_lens: list[int]
    context_lens: list[int]
    window: int | None = None
    soft_cap: float | None = None
    with_sinks: bool = False
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    seed: int = 0

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]


@dataclass
class Batch:
    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    spec: AttentionLayerSpec
    keys: list[torch.Tensor]  # per request, every position's key [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    poison_block: int  # a block of NaN keys and infinite values that no request owns


def first_visible_key(case: Case, r: int) -> int:
    """The first position the request's earliest query row of this step can see."""
    if case.window is None:
        return 0
    return max(0, case.context_lens[r] - case.window + 1)


def make_batch(case: Case, *, poison: bool = False, dtype: torch.dtype = torch.float32) -> Batch:
    """Random K/V histories written into scattered blocks of a paged cache, this step's q/k/v,
    the metadata, and the spec. With `poison`, the block-table entries of blocks wholly before
    each request's window point at the poison block instead of the request's own blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    bs, kv_heads, head_dim = case.block_size, case.num_kv_heads, case.head_dim
    seq_lens = case.seq_lens
    blocks_per_req = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    poison_block = order.pop()
    width = max(blocks_per_req) + 1  # a trailing unused column (entries 0), like the runner's
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    keys = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    kv_cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen)
    kv_cache[0, poison_block] = float("nan")
    kv_cache[1, poison_block] = float("inf")
    slots: list[int] = []
    for r, (n_blocks, ctx, s_len) in enumerate(zip(blocks_per_req, case.context_lens, seq_lens, strict=True)):
        owned, order = order[:n_blocks], order[n_blocks:]
        tables[r, :n_blocks] = torch.tensor(owned, dtype=torch.int32)
        for p in range(ctx):
            kv_cache[0, owned[p // bs], p % bs] = keys[r][p]
            kv_cache[1, owned[p // bs], p % bs] = values[r][p]
        slots += [owned[p // bs] * bs + p % bs for p in range(ctx, s_len)]
        if poison:
            tables[r, : first_visible_key(case, r) // bs] = poison_block
    query_lens = case.query_lens
    k = torch.cat([keys[r][ctx:] for r, ctx in enumerate(case.context_lens)])
    v = torch.cat([values[r][ctx:] for r, ctx in enumerate(case.context_lens)])
    # Larger-than-unit queries, so that soft-capping changes the scores noticeably.
    q = 3 * torch.randn(k.shape[0], case.num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=k.shape[0],
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=starts,
        seq_lens=seq_lens_t,
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
        is_decode_only=max(query_lens) == 1,
    )
    sinks = 2 * torch.randn(case.num_heads, generator=gen) if case.with_sinks else None
    spec = AttentionLayerSpec(sliding_window=case.window, logits_soft_cap=case.soft_cap, sinks=sinks)
    return Batch(
        case, q.to(dtype), k.to(dtype), v.to(dtype), kv_cache.to(dtype), meta, spec, keys, values, poison_block
    )


def dense_reference(batch: Batch, spec: AttentionLayerSpec | None = None) -> torch.Tensor:
    """float64, per request: scores = q.k * scale over every position of the request, soft cap,
    causal + window mask, softmax over [scores, sink], the sink column dropped."""
    case = batch.case
    spec = spec or batch.spec
    scale = case.head_dim**-0.5
    group = case.num_heads // case.num_kv_heads
    out = torch.zeros(batch.q.shape[0], case.num_heads, case.head_dim, dtype=torch.float64)
    row = 0
    for r, (q_len, s_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        q = batch.q[row : row + q_len].double()
        keys = batch.keys[r].double().repeat_interleave(group, dim=1)  # [S, H, D]
        values = batch.values[r].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        query_pos = torch.arange(s_len - q_len, s_len)[:, None]
        key_pos = torch.arange(s_len)[None, :]
        visible = key_pos <= query_pos
        if spec.sliding_window is not None:
            visible &= key_pos > query_pos - spec.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if spec.sinks is not None:
            sink = spec.sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
        row += q_len
    return out


def backend_args(case: Case) -> tuple:
    return case.num_heads, case.num_kv_heads, case.head_dim, case.head_dim**-0.5, case.block_size


def make_torch(case: Case) -> TorchReferenceBackend:
    return TorchReferenceBackend(*backend_args(case))


def make_cpu(case: Case) -> CpuPagedBackend:
    """As configured: the C++ kernel takes short queries, the reference path chunks over 16 rows."""
    return CpuPagedBackend(*backend_args(case))


def make_cpu_kernel_only(case: Case) -> CpuPagedBackend:
    backend = CpuPagedBackend(*backend_args(case))
    backend.max_kernel_query_len = 1 << 30
    return backend


BACKENDS = [
    pytest.param(make_torch, id="torch"),
    pytest.param(make_cpu, id="cpu", marks=needs_cpu_kernels),
    pytest.param(make_cpu_kernel_only, id="cpu-kernel-only", marks=needs_cpu_kernels),
]


def run(make_backend, batch: Batch, spec: AttentionLayerSpec | None = None, backend=None) -> torch.Tensor:
    """The backend's output for the batch (on a copy of its cache) under `spec` (default: the batch's)."""
    backend = backend or make_backend(batch.case)
    layer = spec if spec is not None else batch.spec
    return backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), batch.meta, layer=layer)


# Mixed batches: decodes and prefill chunks whose rows cross the window's edge and block edges.
MIXED = ([1, 6, 1, 9, 20], [20, 11, 3, 0, 9])
CASES = {
    # window 7: not a multiple of the 4-token block; smaller than most contexts
    "window-7": Case(*MIXED, window=7),
    "window-1": Case([1, 3, 1], [9, 5, 0], window=1),  # each query sees itself only
    "window-8-block-multiple": Case(*MIXED, window=8, seed=1),
    "window-larger-than-context": Case(*MIXED, window=64, seed=2),
    "soft-cap": Case(*MIXED, soft_cap=2.0, seed=3),
    "sinks": Case(*MIXED, with_sinks=True, seed=4),
    "all-three-gqa-4": Case(*MIXED, window=5, soft_cap=3.0, with_sinks=True, num_heads=8, seed=5),
    "all-three-mha": Case(*MIXED, window=6, soft_cap=3.0, with_sinks=True, num_kv_heads=4, seed=6),
    "decode-only-window": Case([1] * 5, [30, 2, 17, 8, 40], window=9, with_sinks=True, seed=7),
    "plain": Case(*MIXED, seed=8),
}


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_dense_reference(make_backend, case: Case) -> None:
    batch = make_batch(case)
    out = run(make_backend, batch)
    n = batch.meta.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), dense_reference(batch)[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [CASES["window-7"], CASES["all-three-gqa-4"], CASES["decode-only-window"]],
    ids=["window-7", "all-three-gqa-4", "decode-only-window"],
)
def test_blocks_before_the_window_are_not_read(make_backend, case: Case) -> None:
    clean, poisoned = make_batch(case), make_batch(case, poison=True)
    assert not torch.equal(clean.meta.block_tables, poisoned.meta.block_tables)  # something was poisoned
    out_clean = run(make_backend, clean)
    out_poisoned = run(make_backend, poisoned)
    n = clean.meta.num_actual_tokens
    assert torch.isfinite(out_poisoned[:n]).all()
    assert torch.equal(out_poisoned[:n], out_clean[:n])


@pytest.mark.parametrize("make_backend", BACKENDS)
def test_layers_of_one_step_take_their_own_spec(make_backend) -> None:
    """One backend instance, one step, layers alternating window / full / window of another
    size (the backends cache per-step plans: each layer must still get its own)."""
    case = CASES["window-7"]
    batch = make_batch(case)
    backend = make_backend(case)
    specs = [
        AttentionLayerSpec(sliding_window=7),
        PLAIN_ATTENTION,
        AttentionLayerSpec(sliding_window=3, logits_soft_cap=2.0),
        AttentionLayerSpec(sliding_window=7),
    ]
    n = batch.meta.num_actual_tokens
    for spec in specs:
        out = run(make_backend, batch, spec, backend=backend)
        expected = dense_reference(batch, spec)
        torch.testing.assert_close(out[:n].double(), expected[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make_backend", BACKENDS)
def test_backend_declares_every_feature(make_backend) -> None:
    backend = make_backend(CASES["plain"])
    spec = AttentionLayerSpec(sliding_window=4, logits_soft_cap=1.0, sinks=torch.zeros(4))
    assert backend.unsupported_layer_features(spec) == []
    backend.check_layer_spec(spec)


@pytest.mark.parametrize("make_backend", BACKENDS)
def test_bfloat16_cache(make_backend) -> None:
    """A 16-bit cache (the C++ kernel converts rows to float32 as it reads them): close to the
    float64 reference over the same rounded inputs."""
    case = CASES["all-three-gqa-4"]
    batch = make_batch(case, dtype=torch.bfloat16)
    batch.keys = [keys.to(torch.bfloat16) for keys in batch.keys]
    batch.values = [values.to(torch.bfloat16) for values in batch.values]
    out = run(make_backend, batch)
    n = batch.meta.num_actual_tokens
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:n].double(), dense_reference(batch)[:n], atol=3e-2, rtol=3e-2)
