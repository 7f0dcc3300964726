"""The W4A16 kernel (kernels/triton/int4_*.py) on the CPU: the repack (torch) against the canonical
INT4 form, and the kernel under TRITON_INTERPRET=1 at tiny shapes against the float32 product of
the dequantized weights. The same kernel at Llama-3.1-8B shapes on a GPU, with the inline-PTX
unpacking the interpreter cannot run: tests/gpu/test_int4_kernels_gpu.py.

As in test_triton_attention.py: TRITON_INTERPRET must be set before triton is first imported; if
this process imported triton compiled, the kernel cases skip and one test reruns this file in an
interpreter subprocess.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.int4_reference import random_int4  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton.int4_configs import MAX_FUSED_ROWS, Int4Config, int4_config  # noqa: E402
from tokenmill.kernels.triton.int4_dequant import dequant_plane, magic_for, magic_zeros  # noqa: E402
from tokenmill.kernels.triton.int4_linear import (  # noqa: E402
    dequantize_int4,
    dequantize_weights,
    int4_linear,
    prepare_int4_weights,
)
from tokenmill.kernels.triton.int4_pack import PACK_CHUNK, PACK_K, pack_nibbles, unpack_nibbles  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)


def _prepare(c):
    return prepare_int4_weights(c.q, c.scales, c.zeros, c.group_size, c.g_idx)


# -- the repack (torch only) ----------------------------------------------------------------------------


def test_pack_puts_each_nibble_where_the_kernel_reads_it() -> None:
    """Column j * CHUNK + 2c + h of a pack sits in word 2c + j // 4, bits 4 * (j % 4) + 16 * h; 15s in
    every position (the sign bit of the int32) survive the round trip."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (3, 2 * PACK_K), generator=gen, dtype=torch.uint8)
    q[0] = 15
    packed = pack_nibbles(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2 * PACK_K // 8)
    assert torch.equal(unpack_nibbles(packed), q)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for col in (0, 1, 33, 130, 255, 256 + 77):
        t, within = divmod(col, PACK_K)
        j, c = divmod(within, PACK_CHUNK)
        word = t * PACK_CHUNK + (c - c % 2) + j // 4
        shift = 4 * (j % 4) + 16 * (c % 2)
        assert torch.equal((words[:, word] >> shift) & 0xF, q[:, col].to(torch.int64)), col


@pytest.mark.parametrize(
    "n, k, group_size, act_order",
    [
        (24, 96, -1, False),
        (130, 300, 32, False),
        (40, 512, 64, True),
        (16, 700, 128, True),
        (8, 1024, 512, False),
    ],
)
def test_prepare_keeps_the_weights(n: int, k: int, group_size: int, act_order: bool) -> None:
    """The repacked weights (padded, columns sorted by group for act-order) dequantize to exactly the
    canonical W, per-channel / grouped, N and K not multiples of the tiles."""
    c = random_int4(n, k, group_size, act_order=act_order, seed=n + k)
    w = _prepare(c)
    assert w.n == n and w.k == k and w.act_order == act_order
    assert w.n_padded % 128 == 0 and w.k_padded % PACK_K == 0
    assert torch.equal(dequantize_int4(w), c.dequantize())


def test_prepare_refuses_what_the_kernel_cannot_run() -> None:
    c = random_int4(8, 256, 64)
    with pytest.raises(ValueError, match="group_size 48"):
        scales, zeros = torch.zeros(8, 6, dtype=torch.float16), torch.zeros(8, 6, dtype=torch.uint8)
        prepare_int4_weights(c.q, scales, zeros, 48)
    with pytest.raises(ValueError, match=r"scales must be float16/bfloat16 \[N, G\] = \[8, 4\]"):
        prepare_int4_weights(c.q, c.scales[:, :3], c.zeros, 64)
    with pytest.raises(ValueError, match=r"zeros must be uint8 \[N, G\] = \[8, 4\]"):
        prepare_int4_weights(c.q, c.scales, c.zeros.int(), 64)
    with pytest.raises(ValueError, match="0..15"):
        prepare_int4_weights(c.q + 16, c.scales, c.zeros, 64)
    with pytest.raises(ValueError, match="uint8 \\[N, K\\]"):
        prepare_int4_weights(c.q.int(), c.scales, c.zeros, 64)
    uneven = torch.arange(256, dtype=torch.int32) % 4  # 4 groups of 64, but ...
    uneven[0] = 1  # ... one column moved: groups of 63 and 65
    with pytest.raises(ValueError, match="64 columns in each group"):
        prepare_int4_weights(c.q, c.scales, c.zeros, 64, uneven)
    with pytest.raises(ValueError, match="g_idx must hold one group per input column"):
        prepare_int4_weights(c.q, c.scales, c.zeros, 64, torch.zeros(255, dtype=torch.int32))


def test_int4_linear_refuses_bad_calls() -> None:
    w = _prepare(random_int4(16, 256, 128))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        int4_linear(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="x has 128 input features, the weights 256"):
        int4_linear(torch.zeros(1, 128, dtype=torch.float16), w)
    x = torch.zeros(2, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"residual must be \(2, 16\)"):
        int4_linear(x, w, residual=torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_dtype torch.float32 cannot apply"):
        int4_linear(x, w, residual=torch.zeros(2, 16, dtype=torch.float16), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="split-K runs up to 64 rows"):
        int4_linear(torch.zeros(65, 256, dtype=torch.float16), w, config=Int4Config(64, 32, split_k=2))
    with pytest.raises(ValueError, match="block_n must be"):
        int4_linear(x, w, config=Int4Config(16, 48))
    with pytest.raises(ValueError, match="zero_by_xsum needs scale_after and w_left"):
        int4_linear(x, w, config=Int4Config(16, 32, w_left=False, zero_by_xsum=True))


def test_configs_split_k_only_for_few_rows() -> None:
    """Decode sizes split K to fill the GPU; mid sizes run the fused kernel unsplit; prefill sizes
    dequantize for cuBLAS."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for m in (1, 16, 32, 64):
            cfg = int4_config(m, n, k)
            assert cfg.block_m >= m and cfg.split_k >= 1 and not cfg.dequantize
        for m in (65, MAX_FUSED_ROWS):
            assert int4_config(m, n, k).split_k == 1 and not int4_config(m, n, k).dequantize
        for m in (MAX_FUSED_ROWS + 1, 8192):
            assert int4_config(m, n, k).dequantize
    assert int4_config(1, 4096, 14336).split_k > 1
    # One row, an H200's 132 SMs (the sweep's picks): split 8; 2 stages where a split has 2 packs.
    one_row = {shape: int4_config(1, *shape, 132) for shape in [(6144, 4096), (4096, 4096), (4096, 14336)]}
    assert [(c.split_k, c.num_stages) for c in one_row.values()] == [(8, 2), (8, 2), (8, 4)]
    assert int4_config(1, 28672, 4096, 132).split_k == 1  # gate_up: tiles enough


# -- the kernel, interpreted ----------------------------------------------------------------------------


def _check(y: torch.Tensor, expected: torch.Tensor) -> None:
    """float16 output of a float32-accumulated product: within one float16 rounding plus the 16-bit
    weight rounding (scale-before mode), relative to the output's RMS."""
    rms = expected.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(y.float(), expected.float(), rtol=2**-10, atol=2**-9 * rms)


CASES = [  # (n, k, group_size, act_order, m, config)
    (24, 96, -1, False, 1, Int4Config(16, 16)),  # K below one pack: masked x columns
    (40, 300, 32, False, 5, Int4Config(16, 32, split_k=2)),  # K % pack != 0, split with an empty split
    (40, 512, 64, True, 3, Int4Config(16, 32, split_k=2)),  # act-order gathered in the kernel
    (130, 512, 128, False, 17, Int4Config(32, 64, scale_after=False)),  # 16-bit scaling; N past a tile
    (24, 768, 256, True, 70, Int4Config(64, 16, num_warps=2)),  # act-order by index_select (70 > 64 rows)
    (16, 1024, 512, False, 2, Int4Config(16, 16, split_k=4)),  # groups of two packs
    (40, 512, 64, True, 3, Int4Config(16, 64, w_left=False)),  # weights as the dot's right operand
    (130, 300, 32, False, 33, Int4Config(64, 32, split_k=2, w_left=False, scale_after=False)),
    (24, 768, 256, True, 5, Int4Config(16, 16, dequantize=True)),  # 16-bit weights + F.linear
    (130, 300, -1, False, 70, Int4Config(16, 16, dequantize=True)),
    # Zero points through sum(x) (ZERO_BY_XSUM): per channel with K below a pack, groups of one
    # plane with a partial pack and an empty split, act-order, groups of two packs.
    (24, 96, -1, False, 1, Int4Config(16, 16, zero_by_xsum=True)),
    (40, 300, 32, False, 5, Int4Config(16, 32, split_k=2, zero_by_xsum=True)),
    (40, 512, 64, True, 3, Int4Config(16, 32, split_k=2, zero_by_xsum=True)),
    (16, 1024, 512, False, 2, Int4Config(16, 16, split_k=4, zero_by_xsum=True)),
]


@interpreted_only
@pytest.mark.parametrize("n, k, group_size, act_order, m, config", CASES)
def test_kernel_matches_the_dequantized_product(n, k, group_size, act_order, m, config) -> None:
    c = random_int4(n, k, group_size, act_order=act_order, seed=m * 7 + n)
    w = _prepare(c)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    expected = x.float() @ c.dequantize().t()
    _check(int4_linear(x, w, config=config), expected)


@interpreted_only
def test_kernel_epilogue_bias_residual_out_dtype() -> None:
    """+ bias; + residual written into the residual itself (returned, split-K's last program
    included); float32 output without the 16-bit rounding (fused kernel); leading dimensions kept;
    the same through the dequantize + F.linear path."""
    n, k = 40, 512
    c = random_int4(n, k, 128, seed=3)
    w = _prepare(c)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, k, generator=gen).to(torch.float16)
    bias = torch.randn(n, generator=gen).to(torch.float16)
    residual = torch.randn(2, 3, n, generator=gen).to(torch.float16)
    product = x.float() @ c.dequantize().t()
    for config in (Int4Config(16, 32), Int4Config(16, 16, split_k=2), Int4Config(16, 16, dequantize=True)):
        _check(int4_linear(x, w, bias, config=config), product + bias.float())
        updated = residual.clone()
        out = int4_linear(x, w, residual=updated, config=config)
        assert out is updated
        _check(updated, product + residual.float())
        logits = int4_linear(x, w, out_dtype=torch.float32, config=config)
        assert logits.dtype == torch.float32 and logits.shape == (2, 3, n)
        if config.dequantize:  # F.linear's 16-bit output converted, as CudaLinearMethod does
            _check(logits, product)
        else:
            torch.testing.assert_close(logits, product, rtol=1e-5, atol=1e-4)
    assert w.tile_counters.count_nonzero() == 0  # split-K left its counters at zero for the next call
    assert int4_linear(x[:, :0], w).shape == (2, 0, n)


@interpreted_only
@pytest.mark.parametrize("group_size, act_order", [(32, False), (128, True), (-1, False)])
def test_dequantize_weights_rounds_once(group_size: int, act_order: bool) -> None:
    """The 16-bit weight for cuBLAS: (q - zero) * scale rounded once, columns in the sorted order."""
    c = random_int4(70, 300, group_size, act_order=act_order, seed=9)
    w = _prepare(c)
    dense = c.dequantize()
    if w.perm is not None:
        dense = dense[:, w.perm[: w.k].long()]
    assert torch.equal(dequantize_weights(w, torch.float16), dense.half())


@triton.jit
def _dequant_plane_probe(
    packed_ptr, zeros_ptr, out_ptr, MAGIC: tl.constexpr, R: tl.constexpr, C: tl.constexpr
):
    rows = tl.arange(0, R)
    words = tl.arange(0, C)
    packed = tl.load(packed_ptr + rows[:, None] * C + words[None, :])
    zero_magic = magic_zeros(tl.load(zeros_ptr + rows), MAGIC, out_ptr.dtype.element_ty)
    for j in tl.static_range(8):
        w = dequant_plane(packed, j, zero_magic, MAGIC, out_ptr.dtype.element_ty, False)
        tl.store(out_ptr + rows[:, None] * (8 * C) + j * C + words[None, :], w)


@interpreted_only
def test_magic_number_unpacking_is_exact() -> None:
    """(q | MAGIC) - (zero | MAGIC) read as float16 (1024 + q) is q - zero exactly, for every nibble
    and zero point. (bfloat16's 128 + q: the interpreter keeps a bitcast to bfloat16 as integer bits,
    so the GPU tests check it.)"""
    dtype = torch.float16
    q = torch.arange(16, dtype=torch.uint8).repeat(16, PACK_K // 16)  # every q on every row
    zeros = torch.arange(16, dtype=torch.uint8)  # every zero point
    out = torch.empty(16, PACK_K, dtype=dtype)
    _dequant_plane_probe[(1,)](pack_nibbles(q), zeros, out, MAGIC=magic_for(dtype), R=16, C=PACK_CHUNK)
    assert torch.equal(out.float(), q.float() - zeros.float()[:, None])


@pytest.mark.skipif(INTERPRETED, reason="this process already runs the cases in the interpreter")
def test_cases_pass_in_an_interpreter_subprocess() -> None:
    INTERPRETED_RUN.assert_passes()


@interpreted_only
def test_the_kernel_config_turns_zero_points_through_the_sum_of_x_on(monkeypatch) -> None:
    """KernelConfig.int4_zero_by_xsum reaches the fused kernel's config through the linear method
    (off by default); the product is the dequantized one either way."""
    from tokenmill.config import KernelConfig
    from tokenmill.kernels.triton import int4_linear as int4_module
    from tokenmill.model.layers.int4_linear import Int4LinearMethod
    from tokenmill.model.layers.linear_method import LinearMethod
    from tokenmill.model.loader.quant_config import at_load_quantization

    c = random_int4(64, 256, 128, seed=11)
    w = _prepare(c)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(12)).to(torch.float16)
    configs: list[Int4Config] = []
    fused = int4_module._fused_matmul
    monkeypatch.setattr(int4_module, "_fused_matmul", lambda *a: configs.append(a[-1]) or fused(*a))
    for on in (True, False):
        method = Int4LinearMethod(
            at_load_quantization("awq"), LinearMethod(), use_kernels=True, kernel=KernelConfig(int4_zero_by_xsum=on)
        )
        _check(method.apply_kernels(w, x, None, None, None), x.float() @ c.dequantize().t())
        assert configs[-1].zero_by_xsum is on
