"""Every attention backend honours a layer's AttentionLayerSpec: sliding window, logit soft cap and
attention sinks, alone and together, with GQA, in mixed batches of prefill chunks and decodes;
against a dense per-request float64 softmax over the whole context written here.

A sliding layer must not read the blocks that lie wholly before its window (another layer of the
KV cache frees and reuses them): the poisoned cases point those block-table entries at a block of
NaN keys and infinite values, and the output must not change by a bit.

The Triton backend runs here under TRITON_INTERPRET=1 at tiny shapes (the variable must be set
before triton is first imported; see tests/unit/test_triton_attention.py, whose subprocess
fallback this file shares); tests/gpu/test_attention_layer_spec_gpu.py runs it compiled at real
head dims.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec, AttentionMetadata  # noqa: E402
from tokenmill.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from tokenmill.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from tokenmill.kernels.cpu.build import cpu_kernels_available  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, "-k", "triton")  # run by the subprocess test below

try:
    import triton  # noqa: F401

    from tokenmill.attention.triton_paged import TritonPagedBackend
except ImportError:  # no triton: its cases skip
    TritonPagedBackend = None

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


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_dense_reference_is_transformers_eager_attention(family: str) -> None:
    """The reference these tests hold the backends to is transformers' own: Gemma 2's eager
    attention (soft cap) and gpt-oss's (sinks), each under transformers' sliding-window mask."""
    import importlib
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function

    eager = importlib.import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward
    case = Case([13], [0], window=5, soft_cap=2.0 if family == "gemma2" else None, with_sinks=family == "gpt_oss")
    batch = make_batch(case)
    seq_len, group = case.seq_lens[0], case.num_heads // case.num_kv_heads
    allowed = sliding_window_causal_mask_function(case.window)
    positions = torch.arange(seq_len)
    mask = allowed(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
    additive = torch.zeros(seq_len, seq_len, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=group, training=False, head_dim=case.head_dim)
    if family == "gpt_oss":
        module.sinks = batch.spec.sinks.double()
    heads_first = {"query": batch.q.double(), "key": batch.keys[0].double(), "value": batch.values[0].double()}
    heads_first = {name: t.transpose(0, 1)[None] for name, t in heads_first.items()}  # [1, heads, seq, dim]
    extra = {"softcap": case.soft_cap} if family == "gemma2" else {}
    expected, _ = eager(module, **heads_first, attention_mask=additive, scaling=case.head_dim**-0.5, **extra)
    # (Gemma 2 takes its softmax in float32 whatever the input dtype.)
    torch.testing.assert_close(dense_reference(batch), expected[0], atol=1e-6, rtol=1e-5)


def make_torch(case: Case) -> TorchReferenceBackend:
    return TorchReferenceBackend(*backend_args(case))


def make_cpu(case: Case) -> CpuPagedBackend:
    """As configured: the C++ kernel takes short queries, the reference path chunks over 16 rows."""
    return CpuPagedBackend(*backend_args(case))


def make_cpu_kernel_only(case: Case) -> CpuPagedBackend:
    backend = CpuPagedBackend(*backend_args(case))
    backend.max_kernel_query_len = 1 << 30
    return backend


def make_triton(case: Case, num_kv_splits: int | None = None) -> TritonPagedBackend:
    return TritonPagedBackend(*backend_args(case), num_kv_splits=num_kv_splits)


needs_interpreted_triton = pytest.mark.skipif(
    TritonPagedBackend is None or not INTERPRETED,
    reason="triton is not installed, or was imported compiled in this process (the subprocess test runs these)",
)

BACKENDS = [
    pytest.param(make_torch, id="torch"),
    pytest.param(make_cpu, id="cpu", marks=needs_cpu_kernels),
    pytest.param(make_cpu_kernel_only, id="cpu-kernel-only", marks=needs_cpu_kernels),
    pytest.param(make_triton, id="triton", marks=needs_interpreted_triton),
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


# -- Triton: split-KV decodes, the fused RoPE decode launch, split planning ----------------------

# Decodes and prefill chunks over contexts of several 16-token tiles, a window of 20.
SMALL_TILE_CASE = Case([1, 6, 1, 9], [70, 40, 5, 33], window=20, soft_cap=3.0, with_sinks=True, seed=9)


@needs_interpreted_triton
@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_triton_small_tiles_and_split_decodes_honour_the_spec(num_kv_splits: int, fused_merge: bool) -> None:
    """16-token KV tiles, so that whole tiles lie before the window and are skipped (the default
    tiles are longer than these contexts); decodes whose window spans several splits, some
    splits without tiles (8), merged inside the attention launch or by the separate merge launch
    (the sink joins once, in the merge). Pre-window blocks are poisoned."""
    from tokenmill.kernels.triton.kv_store import store_kv
    from tokenmill.kernels.triton.paged_attention import TileConfig, paged_attention

    case = SMALL_TILE_CASE
    batch = make_batch(case, poison=True)
    cache = batch.kv_cache.clone()
    store_kv(batch.k, batch.v, cache, batch.meta.slot_mapping)
    meta, spec = batch.meta, batch.spec
    heads = case.num_heads
    # NaN scratch: a merge that read a split nobody wrote would show it.
    partial_out = torch.full((meta.num_reqs, heads, num_kv_splits, case.head_dim), float("nan"))
    partial_lse = torch.full((meta.num_reqs, heads, num_kv_splits), float("nan"))
    counters = torch.zeros(meta.num_reqs * case.num_kv_heads, dtype=torch.int32) if fused_merge else None
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        out, batch.q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, decode_only=False, scale=case.head_dim**-0.5,
        num_kv_splits=num_kv_splits, partial_out=partial_out, partial_lse=partial_lse, split_counters=counters,
        decode_config=TileConfig(block_q=1, block_m=16, block_n=16, num_warps=4, num_stages=1, merge_chunk=2),
        prefill_config=TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=1),
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap, sinks=spec.sinks,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), dense_reference(batch), atol=2e-5, rtol=2e-5)
    if counters is not None:
        assert counters.eq(0).all()


@needs_interpreted_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_triton_decode_with_rope_honours_the_spec(num_kv_splits: int) -> None:
    """The fused RoPE + KV store + attention decode launch under a window, soft cap and sinks:
    bit for bit what the RoPE + KV-store launch followed by forward() gives, poisoned blocks unread."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv
    from tokenmill.model.layers.rotary import RotaryEmbedding

    case = Case([1, 1, 1], [21, 0, 7], window=6, soft_cap=3.0, with_sinks=True, num_heads=8, seed=10)
    batch = make_batch(case, poison=True)
    heads, kv_heads, meta = case.num_heads, case.num_kv_heads, batch.meta
    rotary = RotaryEmbedding(case.head_dim, 128, 10000.0, None, dtype=torch.float32)
    positions = torch.tensor(case.context_lens)
    qkv = torch.cat([batch.q, batch.k, batch.v], dim=1)  # un-rotated, as the qkv projection lays them out
    backend = make_triton(case, num_kv_splits=num_kv_splits)

    fused_cache = batch.kv_cache.clone()
    fused = backend.forward_decode_with_rope(
        qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :], positions,
        rotary.cos_cache, rotary.sin_cache, fused_cache, meta, layer=batch.spec,
    )  # fmt: skip
    split_cache, qk = batch.kv_cache.clone(), qkv[:, : heads + kv_heads].clone()
    rope_and_store_kv(
        qk, heads, batch.v, positions, rotary.cos_cache, rotary.sin_cache, split_cache, meta.slot_mapping
    )
    unfused = backend.forward(
        qk[:, :heads], qk[:, heads:], batch.v, split_cache, meta, kv_already_stored=True, layer=batch.spec
    )
    torch.testing.assert_close(fused_cache, split_cache, rtol=0, atol=0, equal_nan=True)  # the poison block
    assert torch.equal(fused, unfused)
    assert torch.isfinite(fused).all()


def test_triton_sliding_layers_plan_splits_for_their_window() -> None:
    """A decode's split count follows the keys it sees: a window caps it, a plain layer keeps
    the count planned for the whole context (host-side planning only)."""
    if TritonPagedBackend is None:
        pytest.skip("triton is not installed")
    case = Case([1], [32767])
    backend = TritonPagedBackend(*backend_args(case))
    meta = AttentionMetadata(
        num_actual_tokens=1, num_reqs=1, max_query_len=1, max_seq_len=32768,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([32768], dtype=torch.int32),
        block_tables=torch.zeros(1, 8192, dtype=torch.int32), slot_mapping=torch.zeros(1, dtype=torch.int64),
        query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32), seq_lens_cpu=torch.tensor([32768]),
        is_decode_only=True,
    )  # fmt: skip
    cpu = torch.device("cpu")
    full = backend._num_kv_splits(meta, cpu)
    assert full > 2
    assert backend._num_kv_splits(meta, cpu, window=256) == 2  # 256 keys: two 128-token splits
    assert backend._num_kv_splits(meta, cpu, window=1 << 20) == full


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the Triton cases in the interpreter")
def test_triton_cases_pass_in_an_interpreter_subprocess() -> None:
    if TritonPagedBackend is None:
        pytest.skip("triton is not installed")
    INTERPRETED_RUN.assert_passes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be a positive"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap must be positive"),
        ({"sinks": torch.zeros(2, 4)}, r"sinks must be one logit per query head"),
    ],
)
def test_a_meaningless_spec_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionLayerSpec(**kwargs)


# The C++ kernel's decode path (AVX2 builds: float32 cache, head_dim a multiple of 32, no soft cap)
# scores 1-3 query heads of a KV head at once, 4 keys a round, then one softmax over the whole
# context: group sizes 1-7 (chunks of 3, 2 and 1 heads), contexts that end inside a block, off a
# multiple of 4 keys, windows and sinks, next to prefill chunks that take the general path.
DECODE_CASES = {
    "gqa-3-d64": Case([1] * 6, [0, 1, 3, 4, 30, 133], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16),
    "gqa-7-d32-window-sinks": Case(
        [1, 1, 5, 1], [50, 9, 20, 77], window=13, with_sinks=True, num_heads=14, num_kv_heads=2, head_dim=32,
        block_size=16, seed=1,
    ),
    "mha-d64-window": Case([1] * 4, [6, 40, 17, 64], window=16, num_heads=4, num_kv_heads=4, head_dim=64, seed=2),
    "gqa-2-d128-sinks": Case([1, 1, 1], [3, 100, 31], with_sinks=True, num_heads=4, num_kv_heads=2, head_dim=128,
                             block_size=8, seed=3),
    "gqa-4-d64-soft-cap": Case([1, 1], [20, 45], soft_cap=2.0, num_heads=8, num_kv_heads=2, head_dim=64, seed=4),
}


@needs_cpu_kernels
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_cpu_decode_rows_match_dense_reference(case: Case) -> None:
    batch = make_batch(case)
    out = run(make_cpu, batch)
    n = batch.meta.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), dense_reference(batch)[:n], atol=2e-5, rtol=2e-5)
    if case.window is not None:  # nothing before the window is read
        poisoned = make_batch(case, poison=True)
        assert torch.equal(run(make_cpu, poisoned)[:n], out[:n])
