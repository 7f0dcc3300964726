"""The FP8 KV cache in the attention backends: values stored as e4m3 of value / scale (saturating
at +-448) with per-KV-head k_scale / v_scale from the layer's AttentionLayerSpec, read as
stored * scale.

The oracle is the same backend over a float32 cache that holds the dequantized values (and is
given this step's K/V already rounded through e4m3): an FP8 cache must attend exactly as if its
values were those, so the only error FP8 adds is the rounding of K and V itself. That holds for
every layer feature (sliding window, soft cap, sinks), in mixed batches, with split-KV decodes and
the fused decode-RoPE launch. The Triton kernels run here under TRITON_INTERPRET=1 at tiny shapes
(the interpreter converts to and from float8e4nv, but rounds exact ties away from zero where the
GPU rounds them to even, so inputs here are float32 draws, which practically never tie).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tests.unit.test_attention_layer_spec import (  # noqa: E402
    CASES,
    SMALL_TILE_CASE,
    Batch,
    Case,
    backend_args,
    dense_reference,
    make_batch,
    make_torch,
)
from tokenmill.attention.backend import AttentionLayerSpec  # noqa: E402
from tokenmill.attention.cpu_paged import CpuPagedBackend  # noqa: E402
from tokenmill.kernels.cpu.build import cpu_kernels_available  # noqa: E402
from tokenmill.kernels.kv_fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, "-k", "triton")  # run by the subprocess test below

try:
    import triton
    import triton.language as tl

    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.triton.kv_fp8 import quantize_kv as triton_quantize_kv

    @triton.jit
    def _quantize_kernel(x_ptr, out_ptr, scale, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, triton_quantize_kv(x, scale, out_ptr.dtype.element_ty), mask=mask)

except ImportError:  # no triton: its cases skip
    TritonPagedBackend = None

needs_interpreted_triton = pytest.mark.skipif(
    TritonPagedBackend is None or not INTERPRETED,
    reason="triton is not installed, or was imported compiled in this process (the subprocess test runs these)",
)


def scales(num_kv_heads: int, base: float) -> torch.Tensor:
    """Per-KV-head scales that are not powers of two, so the e4m3 grid really moves with them."""
    return base * (1.0 + 0.37 * torch.arange(num_kv_heads, dtype=torch.float32))


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(quantize_kv(x, scale), scale)


def fp8_batch(
    case: Case, k_base: float = 0.05, v_base: float = 0.2
) -> tuple[Batch, Batch, AttentionLayerSpec]:
    """(the batch with an FP8 cache, the same batch over a float32 cache of the dequantized values
    with this step's K/V rounded through e4m3 too, the spec with scales). The poison block stays
    NaN / inf in both."""
    batch = make_batch(case)
    k_scale, v_scale = scales(case.num_kv_heads, k_base), scales(case.num_kv_heads, v_base)
    spec = replace(batch.spec, k_scale=k_scale, v_scale=v_scale)
    cache8 = torch.stack([quantize_kv(batch.kv_cache[0], k_scale), quantize_kv(batch.kv_cache[1], v_scale)])
    fp8 = replace(batch, kv_cache=cache8, spec=spec)
    dequant_cache = torch.stack([dequantize_kv(cache8[0], k_scale), dequantize_kv(cache8[1], v_scale)])
    rounded = replace(
        batch,
        k=round_trip(batch.k, k_scale),
        v=round_trip(batch.v, v_scale),
        kv_cache=dequant_cache,
        keys=[round_trip(keys, k_scale) for keys in batch.keys],
        values=[round_trip(values, v_scale) for values in batch.values],
    )
    return fp8, rounded, spec


def dequantized(cache8: torch.Tensor, spec: AttentionLayerSpec) -> torch.Tensor:
    return torch.stack([dequantize_kv(cache8[0], spec.k_scale), dequantize_kv(cache8[1], spec.v_scale)])


# -- the number format ----------------------------------------------------------------------------


def test_quantize_saturates_scales_per_head_and_rounds_to_three_mantissa_bits() -> None:
    x = torch.tensor([[[1000.0, -1000.0, 1.0, 0.1]], [[1000.0, -1000.0, 1.0, 0.1]]])  # [2 tokens, 1 head, 4]
    stored = quantize_kv(x, torch.tensor([1.0]))
    assert stored.dtype == FP8_KV_DTYPE
    assert stored.float()[0, 0].tolist()[:2] == [448.0, -448.0]  # saturated, not NaN
    per_head = torch.randn(64, 3, 16, generator=torch.Generator().manual_seed(0))
    k_scale = torch.tensor([0.01, 1.0, 7.0])
    back = round_trip(per_head, k_scale)
    assert not torch.equal(back, per_head)
    # e4m3 keeps 3 mantissa bits: normal values are within 2^-4 relative of the original.
    normal = (per_head / k_scale[:, None]).abs() >= 2**-6
    relative = ((back - per_head).abs() / per_head.abs())[normal]
    assert relative.max() <= 2**-4 + 1e-6
    # Scales are per KV head: head 2 rounded as x / 7, not x / 1.
    assert torch.equal(back[:, 2], round_trip(per_head[:, 2:3], torch.tensor([7.0]))[:, 0])


def test_spec_refuses_scales_that_are_not_float32_per_head() -> None:
    with pytest.raises(ValueError, match=r"k_scale must be float32 with one scale per KV head"):
        AttentionLayerSpec(k_scale=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"v_scale must be float32"):
        AttentionLayerSpec(v_scale=torch.ones(2, dtype=torch.float16))


def test_backends_declare_fp8() -> None:
    case = CASES["plain"]
    assert make_torch(case).supports_kv_cache_dtype(FP8_KV_DTYPE, torch.float32)
    assert not make_torch(case).supports_kv_cache_dtype(torch.float8_e5m2, torch.float32)
    if cpu_kernels_available()[0]:
        # The C++ kernels read 16- and 32-bit caches only; the runner then takes the reference backend.
        assert not CpuPagedBackend(*backend_args(case)).supports_kv_cache_dtype(FP8_KV_DTYPE, torch.float32)
    if TritonPagedBackend is not None:
        triton_backend = TritonPagedBackend(*backend_args(case))
        for model_dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert triton_backend.supports_kv_cache_dtype(FP8_KV_DTYPE, model_dtype)
        assert not triton_backend.supports_kv_cache_dtype(torch.float8_e5m2, torch.bfloat16)


# -- the torch reference backend -----------------------------------------------------------------

FP8_CASES = ["plain", "window-7", "all-three-gqa-4", "decode-only-window"]


@pytest.mark.parametrize("name", FP8_CASES)
def test_reference_attends_an_fp8_cache_as_its_dequantized_values(name: str) -> None:
    fp8, rounded, spec = fp8_batch(CASES[name])
    backend = make_torch(fp8.case)
    cache8 = fp8.kv_cache.clone()
    out = backend.forward(fp8.q, fp8.k, fp8.v, cache8, fp8.meta, layer=spec)
    # Stored: e4m3 of value / scale at this step's slots, as bytes.
    slots = fp8.meta.slot_mapping
    flat = cache8.view(2, -1, *cache8.shape[3:])
    assert torch.equal(flat[0, slots].view(torch.uint8), quantize_kv(fp8.k, spec.k_scale).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), quantize_kv(fp8.v, spec.v_scale).view(torch.uint8))
    expected = make_torch(rounded.case).forward(
        rounded.q, rounded.k, rounded.v, rounded.kv_cache.clone(), rounded.meta, layer=spec
    )
    n = fp8.meta.num_actual_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:n].double(), dense_reference(rounded)[:n], atol=2e-5, rtol=2e-5)
    # ... and FP8 did change something: the unrounded values attend differently.
    assert not torch.allclose(out[:n].double(), dense_reference(make_batch(fp8.case))[:n], atol=1e-4)


def test_reference_padding_rows_write_nothing_into_an_fp8_cache() -> None:
    fp8, _, spec = fp8_batch(CASES["plain"])
    meta = replace(fp8.meta, slot_mapping=fp8.meta.slot_mapping.clone())
    meta.slot_mapping[::2] = -1
    cache8 = fp8.kv_cache.clone()
    make_torch(fp8.case).forward(fp8.q, fp8.k, fp8.v, cache8, meta, layer=spec)
    flat, before = cache8.view(2, -1, *cache8.shape[3:]), fp8.kv_cache.view(2, -1, *cache8.shape[3:])
    skipped = fp8.meta.slot_mapping[::2]
    assert torch.equal(flat[:, skipped].view(torch.uint8), before[:, skipped].view(torch.uint8))


# -- Triton, interpreted ---------------------------------------------------------------------------


def triton_forward(batch: Batch, spec: AttentionLayerSpec, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TritonPagedBackend(*backend_args(batch.case), **kwargs)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, cache, batch.meta, layer=spec)
    return out, cache


@needs_interpreted_triton
def test_triton_quantize_rounds_like_torch_on_ties_carries_and_subnormals() -> None:
    """Every e4m3 value, the midpoints between neighbours (ties: to even), values just around
    them (carries into the exponent), subnormals and out-of-range values (saturated)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([500.0, -1e6, 1e-9, -3e-3, 0.0])])  # fmt: skip
    for scale in (1.0, 0.37):
        out = torch.empty(x.shape, dtype=FP8_KV_DTYPE)
        _quantize_kernel[(triton.cdiv(x.numel(), 256),)](x * scale, out, scale, x.numel(), BLOCK=256)
        expected = quantize_kv((x * scale)[:, None, None], torch.tensor([scale]))[:, 0, 0]
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


@needs_interpreted_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_kv_head", [4, 0], ids=["qk-together", "k-alone"])
def test_triton_rope_and_store_kv_quantizes_as_rope_then_store(dtype: torch.dtype, first_kv_head: int) -> None:
    """The RoPE launch that stores K/V (k alone: models with a Q/K norm, Qwen3) writes the same
    e4m3 bytes as rope_inplace followed by store_kv, with per-head scales; slot -1 writes nothing."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv, rope_inplace
    from tokenmill.kernels.triton.kv_store import store_kv

    gen = torch.Generator().manual_seed(3)
    num_tokens, kv_heads, head_dim = 5, 2, 16
    x = torch.randn(num_tokens, first_kv_head + kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    positions, slots = torch.tensor([0, 3, 7, 8, 2]), torch.tensor([0, 9, 13, -1, 22])
    angles = torch.arange(32, dtype=torch.float32)[:, None] * (0.1 * torch.arange(1, head_dim // 2 + 1))
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    cache = torch.full((2, 6, 4, kv_heads, head_dim), 3.0).to(FP8_KV_DTYPE)
    k_scale, v_scale = torch.tensor([0.3, 2.5]), torch.tensor([0.7, 0.05])
    expected_x, expected_cache = x.clone(), cache.clone()
    rope_inplace(expected_x, positions, cos, sin)
    store_kv(expected_x[:, first_kv_head:], v, expected_cache, slots, k_scale, v_scale)
    rope_and_store_kv(x, first_kv_head, v, positions, cos, sin, cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(x, expected_x)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    assert (cache.view(torch.uint8) != torch.full_like(cache, 3.0).view(torch.uint8)).any()


@needs_interpreted_triton
def test_triton_store_kv_quantizes_like_the_reference() -> None:
    from tokenmill.kernels.triton.kv_store import store_kv

    fp8, _, spec = fp8_batch(CASES["plain"])
    meta = replace(fp8.meta, slot_mapping=fp8.meta.slot_mapping.clone())
    meta.slot_mapping[1] = -1  # a padding row writes nothing
    cache = fp8.kv_cache.clone()
    store_kv(fp8.k, fp8.v, cache, meta.slot_mapping, spec.k_scale, spec.v_scale)
    expected = fp8.kv_cache.clone()
    make_torch(fp8.case)._store_kv(fp8.k, fp8.v, expected, meta.slot_mapping, scales=(spec.k_scale, spec.v_scale))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@needs_interpreted_triton
@pytest.mark.parametrize("name", ["plain", "all-three-gqa-4"])
def test_triton_attends_an_fp8_cache_as_its_dequantized_values(name: str) -> None:
    fp8, rounded, spec = fp8_batch(CASES[name])
    out, cache8 = triton_forward(fp8, spec)
    expected, _ = triton_forward(rounded, spec)
    n = fp8.meta.num_actual_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:n].double(), dense_reference(rounded)[:n], atol=2e-5, rtol=2e-5)
    ref_cache = fp8.kv_cache.clone()
    make_torch(fp8.case).forward(fp8.q, fp8.k, fp8.v, ref_cache, fp8.meta, layer=spec)
    assert torch.equal(cache8.view(torch.uint8), ref_cache.view(torch.uint8))


@needs_interpreted_triton
@pytest.mark.parametrize("fused_merge", [False, True])
def test_triton_split_decodes_over_an_fp8_cache(fused_merge: bool) -> None:
    """16-token tiles, a window spanning several splits, soft cap and sinks, three splits merged
    inside the attention launch or by the merge launch: the V scale is applied per split."""
    from tokenmill.kernels.triton.paged_attention import TileConfig, paged_attention

    fp8, rounded, spec = fp8_batch(SMALL_TILE_CASE)
    cache8 = fp8.kv_cache.clone()
    make_torch(fp8.case)._store_kv(fp8.k, fp8.v, cache8, fp8.meta.slot_mapping, scales=(spec.k_scale, spec.v_scale))
    case, meta, splits = fp8.case, fp8.meta, 3
    partial_out = torch.full((meta.num_reqs, case.num_heads, splits, case.head_dim), float("nan"))
    partial_lse = torch.full((meta.num_reqs, case.num_heads, splits), float("nan"))
    counters = torch.zeros(meta.num_reqs * case.num_kv_heads, dtype=torch.int32) if fused_merge else None
    out = torch.full_like(fp8.q, float("nan"))
    paged_attention(
        out, fp8.q, cache8, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, decode_only=False, scale=case.head_dim**-0.5,
        num_kv_splits=splits, partial_out=partial_out, partial_lse=partial_lse, split_counters=counters,
        decode_config=TileConfig(block_q=1, block_m=16, block_n=16, num_warps=4, num_stages=1, merge_chunk=2),
        prefill_config=TileConfig(block_q=8, block_m=16, block_n=16, num_warps=4, num_stages=1),
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap, sinks=spec.sinks,
        k_scale=spec.k_scale, v_scale=spec.v_scale,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), dense_reference(rounded), atol=2e-5, rtol=2e-5)


@needs_interpreted_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_triton_fused_decode_rope_stores_and_attends_fp8_as_the_separate_launches(num_kv_splits: int) -> None:
    """The decode launch that rotates q/k, stores K/V and attends: over an FP8 cache it stores
    the same bytes as the RoPE + KV-store launch and attends the new token as stored (bit for
    bit the separate launches' output)."""
    from tokenmill.kernels.triton.elementwise import rope_and_store_kv, rope_inplace
    from tokenmill.kernels.triton.kv_store import store_kv
    from tokenmill.model.layers.rotary import RotaryEmbedding

    case = Case([1, 1, 1], [21, 0, 7], window=6, soft_cap=3.0, with_sinks=True, num_heads=8, seed=10)
    fp8, _, spec = fp8_batch(case)
    heads, kv_heads, meta = case.num_heads, case.num_kv_heads, fp8.meta
    rotary = RotaryEmbedding(case.head_dim, 128, 10000.0, None, dtype=torch.float32)
    positions = torch.tensor(case.context_lens)
    qkv = torch.cat([fp8.q, fp8.k, fp8.v], dim=1)
    backend = TritonPagedBackend(*backend_args(case), num_kv_splits=num_kv_splits)

    fused_cache = fp8.kv_cache.clone()
    fused = backend.forward_decode_with_rope(
        qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :], positions,
        rotary.cos_cache, rotary.sin_cache, fused_cache, meta, layer=spec,
    )  # fmt: skip
    split_cache, qk = fp8.kv_cache.clone(), qkv[:, : heads + kv_heads].clone()
    rope_and_store_kv(
        qk, heads, fp8.v, positions, rotary.cos_cache, rotary.sin_cache, split_cache, meta.slot_mapping,
        k_scale=spec.k_scale, v_scale=spec.v_scale,
    )  # fmt: skip
    unfused = backend.forward(
        qk[:, :heads], qk[:, heads:], fp8.v, split_cache, meta, kv_already_stored=True, layer=spec
    )
    assert torch.equal(fused_cache.view(torch.uint8), split_cache.view(torch.uint8))
    assert torch.equal(fused, unfused)
    # The RoPE launch stores what rope_inplace then store_kv store.
    rotated, store_cache = qkv[:, : heads + kv_heads].clone(), fp8.kv_cache.clone()
    rope_inplace(rotated, positions, rotary.cos_cache, rotary.sin_cache)
    store_kv(rotated[:, heads:], fp8.v, store_cache, meta.slot_mapping, spec.k_scale, spec.v_scale)
    assert torch.equal(store_cache.view(torch.uint8), split_cache.view(torch.uint8))


@needs_interpreted_triton
def test_triton_bf16_queries_over_an_fp8_cache_match_a_bf16_cache_of_its_values() -> None:
    """A bf16 model: e4m3 tiles widen to bf16 exactly; with power-of-two scales the dequantized
    values are bf16 values too, so a bf16 cache holding them gives the same attention."""
    case = CASES["all-three-gqa-4"]
    batch = make_batch(case, dtype=torch.bfloat16)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 0.125])  # two KV heads
    spec = replace(batch.spec, k_scale=k_scale, v_scale=v_scale)
    cache8 = torch.stack([quantize_kv(batch.kv_cache[0], k_scale), quantize_kv(batch.kv_cache[1], v_scale)])
    out, _ = triton_forward(replace(batch, kv_cache=cache8), spec)
    k16, v16 = round_trip(batch.k, k_scale).to(torch.bfloat16), round_trip(batch.v, v_scale).to(torch.bfloat16)
    cache16 = dequantized(cache8, spec).to(torch.bfloat16)
    expected, _ = triton_forward(replace(batch, k=k16, v=v16, kv_cache=cache16), spec)
    n = batch.meta.num_actual_tokens
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the Triton cases in the interpreter")
def test_triton_cases_pass_in_an_interpreter_subprocess() -> None:
    if TritonPagedBackend is None:
        pytest.skip("triton is not installed")
    INTERPRETED_RUN.assert_passes()
