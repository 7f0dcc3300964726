"""TritonPagedBackend on the CPU under TRITON_INTERPRET=1, tiny shapes, against a naive reference
(and the decode step's other Triton kernels: fused RoPE + KV store, greedy sampling).

Triton picks interpreter or compiler when a kernel is decorated, for its own library functions
too, so the variable must be set before triton is first imported. If this process imported
triton earlier without it (a full run on a GPU machine), the cases below are skipped here and
`test_cases_pass_in_an_interpreter_subprocess` runs this file again in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.attention import triton_paged  # noqa: E402
from tokenmill.attention.backend import AttentionMetadata, QKNorm  # noqa: E402
from tokenmill.kernels.triton.kv_store import store_kv  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below


@triton.jit
def _loop_bound_probe(ptr):
    n = tl.load(ptr)
    for i in range(0, n):
        tl.store(ptr + 1 + i, i)


def _interpreter_takes_tensor_loop_bounds() -> bool:
    """Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy 2.x refuses."""
    if not INTERPRETED:
        return False
    try:
        _loop_bound_probe[(1,)](torch.zeros(3, dtype=torch.int32).fill_(2))
    except Exception as error:  # triton's InterpreterError wraps the TypeError
        if "0-dimensional" in str(error):
            return False
        raise
    return True


interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)
interpreter_loops = pytest.mark.skipif(
    not _interpreter_takes_tensor_loop_bounds(),
    reason=f"triton {triton.__version__}'s interpreter cannot run loops with tensor bounds under this NumPy",
)


# -- batch construction and the naive reference ---------------------------------------------------


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v, a random (poisoned-free) cache with scattered blocks, and the step's metadata.

    context_lens are the tokens already cached before this step; the cache holds random values
    there, and this step's k/v go to positions context .. context + query_len - 1.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks that no request owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 1  # a trailing unused column (entries 0) like the runner's
    block_tables = torch.zeros(len(query_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for r, (n_blocks, ctx, qlen) in enumerate(zip(blocks_per_req, context_lens, query_lens, strict=True)):
        owned, order = order[:n_blocks], order[n_blocks:]
        block_tables[r, :n_blocks] = torch.tensor(owned, dtype=torch.int32)
        slots += [owned[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + qlen)]
    num_actual = sum(query_lens)
    num_tokens = num_actual + num_padding_tokens
    slot_mapping = torch.tensor(slots + [-1] * num_padding_tokens, dtype=torch.int64)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=num_actual,
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
        is_decode_only=max(query_lens) == 1,
    )
    return q, k, v, kv_cache, meta


def naive_store(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    expected = kv_cache.clone()
    real = slot_mapping >= 0
    flat = expected.view(2, -1, *kv_cache.shape[3:])
    flat[0, slot_mapping[real]] = k[real]
    flat[1, slot_mapping[real]] = v[real]
    return expected


def naive_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """float64 attention per request from the gathered pages; rows past num_actual_tokens stay 0."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    key_pool = kv_cache[0].reshape(-1, num_kv_heads, head_dim).double()
    value_pool = kv_cache[1].reshape(-1, num_kv_heads, head_dim).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc_cpu.tolist()
    for r in range(meta.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], int(meta.seq_lens_cpu[r])
        positions = torch.arange(seq_len)
        slots = meta.block_tables[r, positions // block_size].long() * block_size + positions % block_size
        keys = key_pool[slots].repeat_interleave(group, dim=1)
        values = value_pool[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        query_pos = seq_len - (end - start) + torch.arange(end - start)
        scores.masked_fill_(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), "non-finite values in the kernel output"
    return float((actual - expected).norm() / expected.norm())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size, **kwargs):
    backend = triton_paged.TritonPagedBackend(
        q.shape[1], num_kv_heads, q.shape[2], q.shape[2] ** -0.5, block_size, **kwargs
    )
    cache = kv_cache.clone()
    out = backend.forward(q, k, v, cache, meta)
    return out, cache


# -- tests -------------------------------------------------------------------------------------------


@interpreted_only
def test_store_kv_writes_each_slot_and_skips_padding() -> None:
    q, k, v, kv_cache, meta = make_batch(
        [3, 1, 1], [5, 7, 0], 4, 2, 16, 4, torch.float32, num_padding_tokens=2
    )
    expected = naive_store(k, v, kv_cache, meta.slot_mapping)
    cache = kv_cache.clone()
    store_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, expected)  # exact, and padding rows (slot -1) changed nothing


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (2, 2, 64, torch.float32),  # MHA
        (4, 2, 128, torch.float16),  # GQA 2
        (8, 2, 64, torch.bfloat16),  # GQA 4
        (3, 1, 64, torch.float32),  # GQA 3: a group that is not a power of two
    ],
)
def test_mixed_batch_matches_naive(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    # A prefill chunk on top of a cached prefix, a fresh prefill, and decodes; block_size 4 makes
    # every KV tile span several scattered pages.
    block_size = 4
    q, k, v, kv_cache, meta = make_batch(
        [9, 1, 5, 1],
        [6, 13, 0, 2],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        num_padding_tokens=2,
    )
    out, cache = run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size)
    expected_cache = naive_store(k, v, kv_cache, meta.slot_mapping)
    assert torch.equal(cache, expected_cache)
    n = meta.num_actual_tokens
    expected = naive_attention(q, expected_cache, meta, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out[:n], expected[:n]) < TOLERANCE[dtype]


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_decode_split_kv_equals_unsplit(num_kv_splits: int) -> None:
    # Contexts shorter than, equal to and longer than one split; 8 splits leave some empty.
    block_size, num_kv_heads = 8, 2
    q, k, v, kv_cache, meta = make_batch(
        [1, 1, 1], [70, 5, 33], 4, num_kv_heads, 64, block_size, torch.float32, num_padding_tokens=1
    )
    assert meta.is_decode_only
    unsplit, _ = run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size, num_kv_splits=1)
    split, cache = run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size, num_kv_splits=num_kv_splits)
    n = meta.num_actual_tokens
    assert relative_error(split[:n], unsplit[:n]) < 1e-6
    expected = naive_attention(q, naive_store(k, v, kv_cache, meta.slot_mapping), meta, 64**-0.5)
    assert relative_error(split[:n], expected[:n]) < TOLERANCE[torch.float32]


@interpreted_only
@interpreter_loops
def test_mixed_batch_with_splits_matches_naive() -> None:
    block_size, num_kv_heads = 4, 1
    q, k, v, kv_cache, meta = make_batch([6, 1], [10, 40], 2, num_kv_heads, 64, block_size, torch.bfloat16)
    out, cache = run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size, num_kv_splits=3)
    expected = naive_attention(q, cache, meta, 64**-0.5)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("num_kv_splits", [1, 2, 3])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 2]])
def test_every_real_row_is_written(num_kv_splits: int, query_lens: list[int], fused_merge: bool) -> None:
    """Split partials merged by a second launch, or inside the attention launch by the last
    program of each (request, KV head), which leaves the counters at zero for the next call."""
    from tokenmill.kernels.triton.paged_attention import paged_attention

    block_size, num_kv_heads, head_dim = 4, 1, 16
    q, k, v, kv_cache, meta = make_batch(
        query_lens, [6, 0, 9], 2, num_kv_heads, head_dim, block_size, torch.float32
    )
    store_kv(k, v, kv_cache, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    heads = q.shape[1]
    partial_out = torch.full((meta.num_reqs, heads, num_kv_splits, head_dim), float("nan"))
    partial_lse = torch.full((meta.num_reqs, heads, num_kv_splits), float("nan"))
    counters = torch.zeros(meta.num_reqs * num_kv_heads, dtype=torch.int32) if fused_merge else None
    for _ in range(2):  # the second call reuses the counters the first one reset
        out.fill_(float("nan"))
        paged_attention(
            out, q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, decode_only=meta.is_decode_only,
            scale=head_dim**-0.5, num_kv_splits=num_kv_splits, partial_out=partial_out, partial_lse=partial_lse,
            split_counters=counters,
        )  # fmt: skip
        assert (
            relative_error(out, naive_attention(q, kv_cache, meta, head_dim**-0.5)) < TOLERANCE[torch.float32]
        )
        if counters is not None:
            assert counters.eq(0).all()


@interpreted_only
@interpreter_loops
def test_zero_length_padding_requests_are_ignored() -> None:
    # CUDA-graph style padding: extra requests with no query rows and seq_len 0.
    block_size, num_kv_heads = 4, 1
    q, k, v, kv_cache, meta = make_batch([1, 1], [9, 3], 2, num_kv_heads, 16, block_size, torch.float32)
    padded = AttentionMetadata(
        num_actual_tokens=2,
        num_reqs=4,
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        query_start_loc=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([10, 4, 0, 0], dtype=torch.int32),
        block_tables=torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)]),
        slot_mapping=meta.slot_mapping,
        query_start_loc_cpu=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([10, 4, 0, 0], dtype=torch.int32),
        is_decode_only=True,
    )
    for splits in (1, 2):
        out, cache = run_backend(q, k, v, kv_cache, padded, num_kv_heads, block_size, num_kv_splits=splits)
        expected = naive_attention(q, cache, meta, 16**-0.5)
        assert relative_error(out, expected) < TOLERANCE[torch.float32]


def test_split_count_rule() -> None:
    choose = triton_paged.choose_num_kv_splits
    assert choose(num_reqs=1, num_kv_heads=8, max_context_len=4096, num_sms=132) == 32
    assert choose(num_reqs=1, num_kv_heads=8, max_context_len=1 << 20, num_sms=132) == 64
    assert choose(num_reqs=64, num_kv_heads=8, max_context_len=4096, num_sms=132) == 2
    assert choose(num_reqs=256, num_kv_heads=8, max_context_len=4096, num_sms=132) == 1  # grid already full
    assert choose(num_reqs=1, num_kv_heads=8, max_context_len=100, num_sms=132) == 1  # too short to split
    for num_reqs in range(1, 40):
        splits = choose(num_reqs=num_reqs, num_kv_heads=2, max_context_len=1 << 20, num_sms=132)
        assert 1 <= splits <= triton_paged.MAX_KV_SPLITS and splits & (splits - 1) == 0


@interpreted_only
@interpreter_loops
def test_matches_torch_reference_backend() -> None:
    if importlib.util.find_spec("tokenmill.attention.torch_ref") is None:
        pytest.skip("tokenmill.attention.torch_ref is not written yet")
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 64
    q, k, v, kv_cache, meta = make_batch(
        [7, 1, 1], [5, 11, 0], num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    out, cache = run_backend(q, k, v, kv_cache, meta, num_kv_heads, block_size)
    reference = TorchReferenceBackend(num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size)
    ref_cache = kv_cache.clone()
    ref_out = reference.forward(q, k, v, ref_cache, meta)
    assert torch.equal(cache, ref_cache)
    assert relative_error(out, ref_out) < 1e-5


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases in the interpreter")
def test_cases_pass_in_an_interpreter_subprocess() -> None:
    INTERPRETED_RUN.assert_passes()


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_kv_head", [4, 0], ids=["qk-together", "k-alone"])
def test_rope_and_store_kv_equals_rope_then_store(dtype: torch.dtype, first_kv_head: int) -> None:
    """The fused RoPE + KV-store launch of the CUDA decoder path: the same rotated q/k as
    rope_inplace, and the same cache as store_kv afterwards; slot -1 (graph padding) writes nothing."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv, rope_inplace

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 5, 2, 16, 4, 6
    x = torch.randn(num_tokens, first_kv_head + num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 7, 8, 2])
    slot_mapping = torch.tensor([0, 9, 13, -1, 22])
    angles = torch.arange(32, dtype=torch.float32)[:, None] * (0.1 * torch.arange(1, head_dim // 2 + 1))
    cos_cache = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin_cache = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)

    expected_x, expected_cache = x.clone(), cache.clone()
    rope_inplace(expected_x, positions, cos_cache, sin_cache)
    store_kv(expected_x[:, first_kv_head:], v, expected_cache, slot_mapping)
    rope_and_store_kv(x, first_kv_head, v, positions, cos_cache, sin_cache, cache, slot_mapping)
    assert torch.equal(x, expected_x)
    assert torch.equal(cache, expected_cache)

    # And the rotation is RoPE: x * cos + rotate_half(x) * sin, up to rounding.
    original = torch.randn(num_tokens, first_kv_head + num_kv_heads, head_dim, generator=gen)
    rotated = original.clone()
    cos32 = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin32 = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    rope_inplace(rotated, positions, cos32, sin32)
    half = head_dim // 2
    rotate_half = torch.cat([-original[..., half:], original[..., :half]], dim=-1)
    cos = angles.cos()[positions].repeat(1, 2)[:, None]
    sin = angles.sin()[positions].repeat(1, 2)[:, None]
    assert torch.allclose(rotated, original * cos + rotate_half * sin, atol=1e-5)


@interpreted_only
@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16-rmsnorm", "bf16-gemma-weight"],
)
def test_rope_with_qk_norm_equals_norm_then_rope(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """The RoPE launches with a layer's Q/K norms (prefill and mixed steps of Qwen3 / Gemma 3):
    the same q/k and cache as normalizing each head with the model's own norm first."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv, rope_inplace
    from tokenmill.model.layers.rmsnorm import rms_norm, rms_norm_float32_weight

    gen = torch.Generator().manual_seed(5)
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, eps = 5, 4, 2, 16, 4, 1e-6
    x = (torch.randn(num_tokens, num_q_heads + num_kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype)
    k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype)
    norm = rms_norm_float32_weight if weight_dtype == torch.float32 else rms_norm
    positions = torch.tensor([0, 3, 7, 8, 2])
    slot_mapping = torch.tensor([0, 9, 13, -1, 22])
    angles = torch.arange(32, dtype=torch.float32)[:, None] * (0.1 * torch.arange(1, head_dim // 2 + 1))
    cos_cache = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin_cache = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)

    expected_x, expected_cache = x.clone(), cache.clone()
    expected_x[:, :num_q_heads] = norm(x[:, :num_q_heads], q_weight, eps)
    expected_x[:, num_q_heads:] = norm(x[:, num_q_heads:], k_weight, eps)
    rope_and_store_kv(expected_x, num_q_heads, v, positions, cos_cache, sin_cache, expected_cache, slot_mapping)
    fused_x, fused_cache = x.clone(), cache.clone()
    rope_and_store_kv(
        fused_x, num_q_heads, v, positions, cos_cache, sin_cache, fused_cache, slot_mapping,
        qk_norm=QKNorm(q_weight, k_weight, eps),
    )  # fmt: skip
    rotated_only = x.clone()
    rope_inplace(rotated_only, positions, cos_cache, sin_cache, qk_norm=QKNorm(q_weight, k_weight, eps), first_kv_head=4)
    # Only 1/rms may differ in its last bit (reduction order).
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-3}
    torch.testing.assert_close(fused_x.float(), expected_x.float(), **tolerance)
    torch.testing.assert_close(fused_cache.float(), expected_cache.float(), **tolerance)
    torch.testing.assert_close(rotated_only.float(), expected_x.float(), **tolerance)
    with pytest.raises(ValueError, match="k norm weight"):
        rope_inplace(x.clone(), positions, cos_cache, sin_cache, qk_norm=QKNorm(q_weight, k_weight[:8], eps))


@interpreted_only
def test_greedy_sample_matches_torch_argmax_and_flags_non_finite_rows() -> None:
    from tokenmill.kernels.triton import greedy as greedy_triton

    gen = torch.Generator().manual_seed(5)
    vocab = 3 * greedy_triton.BLOCK + 17  # a partial last slice
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, 5] = logits[1, greedy_triton.BLOCK + 9] = 100.0  # a tie across slices: the first wins
    logits[2, 3 * greedy_triton.BLOCK + 16] = 50.0  # the max in the partial slice
    logits[3, 7] = float("nan")
    logits[4, 11] = float("-inf")
    out = greedy_triton.greedy_sample(logits)
    assert out.dtype == torch.int64 and out.shape == (2, 5)
    assert (
        out[0, :3].tolist() == logits[:3].argmax(dim=-1).tolist() == [logits[0].argmax().item(), 5, vocab - 1]
    )
    assert out[1].tolist() == [0, 0, 0, 1, 1]


def _rope_tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenmill.model.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 128, 10000.0, None, dtype=dtype)
    return rotary.cos_cache, rotary.sin_cache


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype", "num_kv_splits"),
    [
        (4, 2, 16, torch.float32, 1),
        (4, 2, 16, torch.float32, 3),  # the new token's split is not the last one
        (8, 2, 64, torch.bfloat16, 2),  # GQA 4
        (3, 1, 64, torch.float16, 4),  # GQA 3 (group padded), some splits empty
    ],
)
def test_decode_with_rope_equals_rope_store_then_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_kv_splits: int
) -> None:
    """The decode-only launch that rotates q/k, stores K/V and attends: the same cache and the
    same output, bit for bit, as the separate RoPE + KV-store launch followed by the attention
    launch; q, k and v are left un-rotated; padding rows (slot -1) write nothing."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv

    block_size = 4
    contexts = [21, 0, 7]  # 0: the new token is the whole context; 7: ends a block exactly
    q, k, v, kv_cache, meta = make_batch(
        [1, 1, 1], contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, num_padding_tokens=1
    )
    positions = torch.tensor(contexts + [0])
    cos, sin = _rope_tables(head_dim, dtype)
    # q, k, v side by side in one row, as the model's qkv projection lays them out.
    qkv = torch.cat([q, k, v], dim=1)
    heads_qk = num_heads + num_kv_heads
    backend = triton_paged.TritonPagedBackend(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size, num_kv_splits=num_kv_splits
    )

    fused_qkv, fused_cache = qkv.clone(), kv_cache.clone()
    fused = backend.forward_decode_with_rope(
        fused_qkv[:, :num_heads], fused_qkv[:, num_heads:heads_qk], fused_qkv[:, heads_qk:],
        positions, cos, sin, fused_cache, meta,
    )  # fmt: skip
    assert torch.equal(fused_qkv, qkv)  # inputs untouched

    split_qkv, split_cache = qkv.clone(), kv_cache.clone()
    qk = split_qkv[:, :heads_qk]
    rope_and_store_kv(
        qk, num_heads, split_qkv[:, heads_qk:], positions, cos, sin, split_cache, meta.slot_mapping
    )
    unfused = backend.forward(
        qk[:, :num_heads],
        qk[:, num_heads:],
        split_qkv[:, heads_qk:],
        split_cache,
        meta,
        kv_already_stored=True,
    )
    n = meta.num_actual_tokens
    assert torch.equal(fused_cache, split_cache)
    assert torch.equal(fused[:n], unfused[:n])
    expected = naive_attention(qk[:, :num_heads], split_cache, meta, head_dim**-0.5)
    assert relative_error(fused[:n], expected[:n]) < TOLERANCE[dtype]


def _inverse_rms(rows: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(rows.float().pow(2).mean(-1) + eps)


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize("qk_norms", [False, True], ids=["plain", "qk-norms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_rope_scales_by_the_deferred_norm(dtype: torch.dtype, qk_norms: bool) -> None:
    """With `norm_source` (the un-normalized residual rows q/k/v were projected from), the launch
    scales q, k and v by 1/rms(row) first: the same cache and output as passing them scaled; with
    Q/K norms (Qwen3's deferred-norm decode) those follow the scale, as they follow the projection."""
    num_heads, num_kv_heads, head_dim, hidden, eps, block_size = 8, 2, 16, 48, 1e-5, 4
    contexts = [21, 0, 7]
    q, k, v, kv_cache, meta = make_batch(
        [1, 1, 1], contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, num_padding_tokens=1
    )
    positions = torch.tensor(contexts + [0])
    cos, sin = _rope_tables(head_dim, dtype)
    residual = (torch.randn(4, hidden, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    qkv = torch.cat([q, k, v], dim=1)
    heads_qk = num_heads + num_kv_heads
    # What the deferred norm should amount to: every row of the projection scaled by 1/rms.
    scaled = (qkv.float() * _inverse_rms(residual, eps)[:, None, None]).to(dtype)
    backend = triton_paged.TritonPagedBackend(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size, num_kv_splits=2
    )
    qk_norm = None
    if qk_norms:
        gen = torch.Generator().manual_seed(4)
        q_weight, k_weight = (0.5 + torch.rand(2, head_dim, generator=gen)).to(dtype)
        qk_norm = QKNorm(q_weight, k_weight, eps)
    results = []
    for rows, source in ((qkv, residual), (scaled, None)):
        cache = kv_cache.clone()
        out = backend.forward_decode_with_rope(
            rows[:, :num_heads], rows[:, num_heads:heads_qk], rows[:, heads_qk:], positions, cos, sin,
            cache, meta, norm_source=source, norm_eps=eps, qk_norm=qk_norm,
        )  # fmt: skip
        results.append((out[: meta.num_actual_tokens].float(), cache.float()))
    (out, cache), (expected_out, expected_cache) = results
    # Both round q/k/v once after the scale; only 1/rms may differ in its last bit (reduction order).
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-3}
    torch.testing.assert_close(cache, expected_cache, **tolerance)
    torch.testing.assert_close(out, expected_out, **tolerance)
    with pytest.raises(ValueError, match="norm_source"):
        backend.forward_decode_with_rope(
            q, k, v, positions, cos, sin, kv_cache.clone(), meta, norm_source=residual[:2], norm_eps=eps
        )


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16-rmsnorm", "bf16-gemma-weight"],
)
def test_decode_with_rope_applies_the_qk_norms(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """With `qk_norm` (Qwen3's RMSNorm, Gemma 3's float32 1 + w) the launch normalizes each q and k
    head before RoPE: the same cache and output as normalizing them with the model's own norm
    (layers/rmsnorm.py) and passing the results in."""
    from tokenmill.model.layers.rmsnorm import rms_norm, rms_norm_float32_weight

    num_heads, num_kv_heads, head_dim, eps, block_size = 8, 2, 16, 1e-6, 4
    contexts = [21, 0, 7]
    q, k, v, kv_cache, meta = make_batch(
        [1, 1, 1], contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, num_padding_tokens=1
    )
    gen = torch.Generator().manual_seed(8)
    q, k = (q.float() * 4).to(dtype), (k.float() * 3).to(dtype)  # far from unit rms
    q_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype)
    k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(weight_dtype)
    norm = rms_norm_float32_weight if weight_dtype == torch.float32 else rms_norm
    positions = torch.tensor(contexts + [0])
    cos, sin = _rope_tables(head_dim, dtype)
    backend = triton_paged.TritonPagedBackend(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size, num_kv_splits=2
    )
    results = []
    for q_in, k_in, qk_norm in (
        (q, k, QKNorm(q_weight, k_weight, eps)),
        (norm(q, q_weight, eps), norm(k, k_weight, eps), None),
    ):
        cache = kv_cache.clone()
        out = backend.forward_decode_with_rope(
            q_in.clone(), k_in.clone(), v, positions, cos, sin, cache, meta, qk_norm=qk_norm
        )
        results.append((out[: meta.num_actual_tokens].float(), cache.float()))
    (out, cache), (expected_out, expected_cache) = results
    assert not torch.equal(results[0][1], kv_cache.float())  # the new keys were stored
    # Both round where the model rounds; only 1/rms may differ in its last bit (reduction order).
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-3}
    torch.testing.assert_close(cache, expected_cache, **tolerance)
    torch.testing.assert_close(out, expected_out, **tolerance)
    with pytest.raises(ValueError, match="k_norm_weight"):
        backend.forward_decode_with_rope(
            q, k, v, positions, cos, sin, kv_cache.clone(), meta, qk_norm=QKNorm(q_weight, k_weight[:8], eps)
        )


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_unweighted_norm_for_folded_norm_weights(dtype: torch.dtype) -> None:
    """A model with its norm weights folded into the matmuls (W' = w * W): silu_mul given the
    residual rows turns h @ W' into the MLP activation of RMSNorm(h) * w @ W, and add_rms_norm
    without a weight gives the normalized rows that W' expects."""
    from tokenmill.kernels.triton.elementwise import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(4)
    rows, hidden, intermediate, eps = 5, 64, 96, 1e-6
    residual = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    norm_weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    gate_up_weight = (torch.randn(2 * intermediate, hidden, generator=gen) * 0.1).to(dtype)
    folded = gate_up_weight * norm_weight  # one rounding, as CausalLM.fold_norm_weights does

    normed = add_rms_norm(residual.clone(), None, eps)
    expected_normed = (residual.float() * _inverse_rms(residual, eps)[:, None]).to(dtype)
    one_ulp = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(normed, expected_normed, **one_ulp)

    act = silu_mul((residual.float() @ folded.float().t()).to(dtype), norm_source=residual, eps=eps)
    reference_gate_up = (expected_normed * norm_weight).float() @ gate_up_weight.float().t()
    expected_act = (
        torch.nn.functional.silu(reference_gate_up[:, :intermediate]) * reference_gate_up[:, intermediate:]
    )
    assert relative_error(act, expected_act) < TOLERANCE[dtype]
    # Without the residual rows it is the plain activation of its input.
    plain = silu_mul(reference_gate_up.to(dtype))
    assert relative_error(plain, expected_act) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="norm_source"):
        silu_mul(reference_gate_up.to(dtype), norm_source=residual[:2], eps=eps)


@interpreted_only
def test_decode_with_rope_refuses_mixed_batches() -> None:
    q, k, v, kv_cache, meta = make_batch([3, 1], [2, 5], 2, 1, 16, 4, torch.float32)
    cos, sin = _rope_tables(16, torch.float32)
    backend = triton_paged.TritonPagedBackend(2, 1, 16, 0.25, 4)
    with pytest.raises(ValueError, match="decode-only"):
        backend.forward_decode_with_rope(q, k, v, torch.zeros(4, dtype=torch.long), cos, sin, kv_cache, meta)


@interpreted_only
@interpreter_loops
@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("min_kv_per_split", [0, 32])
def test_splits_without_tiles_and_min_kv_per_split(fused_merge: bool, min_kv_per_split: int) -> None:
    """8 splits of 16-token tiles over contexts of 71, 6 and 34 tokens: splits past the last tile
    exit without writing anything, and the merge (in-launch or separate) reads only the splits
    that had tiles; `min_kv_per_split` thins them out further at run time."""
    from tokenmill.kernels.triton.paged_attention import TileConfig, paged_attention

    block_size, num_kv_heads, head_dim, splits = 8, 2, 16, 8
    q, k, v, kv_cache, meta = make_batch(
        [1, 1, 1], [70, 5, 33], 4, num_kv_heads, head_dim, block_size, torch.float32
    )
    store_kv(k, v, kv_cache, meta.slot_mapping)
    expected = naive_attention(q, kv_cache, meta, head_dim**-0.5)
    # NaN scratch: a merge that read a split nobody wrote would show it.
    partial_out = torch.full((meta.num_reqs, q.shape[1], splits, head_dim), float("nan"))
    partial_lse = torch.full((meta.num_reqs, q.shape[1], splits), float("nan"))
    counters = torch.zeros(meta.num_reqs * num_kv_heads, dtype=torch.int32) if fused_merge else None
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        paged_attention(
            out, q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=1, decode_only=True, scale=head_dim**-0.5,
            num_kv_splits=splits, partial_out=partial_out, partial_lse=partial_lse, split_counters=counters,
            decode_config=TileConfig(block_q=1, block_m=16, block_n=16, num_warps=4, num_stages=1, merge_chunk=2),
            min_kv_per_split=min_kv_per_split,
        )  # fmt: skip
        assert relative_error(out, expected) < TOLERANCE[torch.float32]
        if counters is not None:
            assert counters.eq(0).all()
    # Request 1 (7 tokens, one tile) wrote split 0 only; request 0 (71 tokens, 5 tiles) 5 splits,
    # or 3 with at least 2 tiles each.
    assert partial_lse[1, :, 1:].isnan().all() and not partial_lse[1, :, 0].isnan().any()
    used = 5 if min_kv_per_split == 0 else 3
    assert not partial_lse[0, :, :used].isnan().any() and partial_lse[0, :, used:].isnan().all()


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features", [64, 96])  # 96: K not a multiple of the K slice (masked loads)
def test_row_gemv_matches_a_float32_matmul_rounded_once(dtype: torch.dtype, in_features: int) -> None:
    """The row GEMV (one-row decode matmuls on CUDA) computes residual + x @ W.T + bias in float32
    and rounds once, as cuBLAS's epilogue does: within one ulp of that (the sum order differs),
    with the residual updated in place when it is also the output, and float32 output (lm_head's
    logits) without rounding to the input dtype."""
    from tokenmill.kernels.triton.gemv import row_gemv

    gen = torch.Generator().manual_seed(in_features)
    out_features = 24
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.2).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    residual = torch.randn(1, out_features, generator=gen).to(dtype)
    product = x.float() @ weight.float().t()
    one_ulp = {"rtol": 2**-7 if dtype == torch.bfloat16 else 2**-10, "atol": 1e-5}

    torch.testing.assert_close(row_gemv(x, weight), product.to(dtype), **one_ulp)
    with_bias = row_gemv(x, weight, bias)
    torch.testing.assert_close(with_bias, (product + bias.float()).to(dtype), **one_ulp)
    in_place = residual.clone()
    assert row_gemv(x, weight, residual=in_place, out=in_place) is in_place
    torch.testing.assert_close(in_place, (product + residual.float()).to(dtype), **one_ulp)
    logits = row_gemv(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, product, rtol=1e-5, atol=1e-5)


def test_row_gemv_refuses_what_it_cannot_do() -> None:
    from tokenmill.kernels.triton.gemv import row_gemv, row_gemv_config, use_row_gemv

    for n, k in [(6144, 4096), (4096, 14336), (128256, 4096), (24, 96)]:
        assert row_gemv_config(n, k)[0] <= triton.next_power_of_2(k)
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one contiguous row"):
        row_gemv(torch.zeros(2, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="contiguous"):
        row_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(64, 8, dtype=torch.bfloat16).t())
    assert not use_row_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), weight)  # CPU: F.linear
    row = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual must hold 8"):
        row_gemv(row, weight, residual=torch.zeros(1, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias must hold 8"):
        row_gemv(row, weight, bias=torch.zeros(16, dtype=torch.bfloat16)[::2])


@interpreted_only
@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize("shape", [(64, 128), (24, 96)])  # (24, 96): N and K not multiples of the tiles
def test_skinny_gemm_matches_a_float32_matmul_rounded_once(rows: int, shape: tuple[int, int]) -> None:
    """The skinny GEMM (2-8-row decode matmuls on CUDA): x @ W.T + bias in float32, rounded once,
    within one ulp; float32 output without rounding. float16: the interpreter's tl.dot does not
    take bfloat16 (the GPU test covers it)."""
    from tokenmill.kernels.triton.skinny_gemm import skinny_gemm

    dtype = torch.float16
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.2).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    product = x.float() @ weight.float().t()
    one_ulp = {"rtol": 2**-10, "atol": 1e-4}
    torch.testing.assert_close(skinny_gemm(x, weight), product.to(dtype), **one_ulp)
    torch.testing.assert_close(skinny_gemm(x, weight, bias), (product + bias.float()).to(dtype), **one_ulp)
    logits = skinny_gemm(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, product, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(x[:1], weight)
