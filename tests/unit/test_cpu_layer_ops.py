"""The C++ per-layer ops of CpuNativeLayerOps (csrc/cpu_layer_ops.cpp) against the PyTorch ops."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu.build import cpu_kernels_available
from tokenmill.model.layers.layer_ops import CpuNativeLayerOps, RopeInputs, TorchLayerOps, select_layer_ops
from tokenmill.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")


def test_the_cpu_takes_the_native_ops() -> None:
    assert isinstance(select_layer_ops("cpu"), CpuNativeLayerOps)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_pending", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_add_rms_norm_equals_torch(rows: int, with_pending: bool, with_weight: bool) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 576) * 3
    pending = torch.randn(rows, 576) if with_pending else None
    weight = torch.randn(576) if with_weight else None
    x_ref, x_ours = x.clone(), x.clone()
    expected = TorchLayerOps().add_rms_norm(x_ref, weight, 1e-5, pending)
    ours = CpuNativeLayerOps().add_rms_norm(x_ours, weight, 1e-5, pending)
    torch.testing.assert_close(x_ours, x_ref, rtol=0, atol=0)  # the residual add, in place
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_add_rms_norm_keeps_torch_for_other_dtypes() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    out = CpuNativeLayerOps().add_rms_norm(x, weight, 1e-5, None)
    assert torch.equal(out, TorchLayerOps().add_rms_norm(x, weight, 1e-5, None))


@pytest.mark.parametrize("tokens", [1, 5])
def test_rotate_equals_torch_on_a_strided_view(tokens: int) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None, dtype=torch.float32)
    positions = torch.randint(0, 256, (tokens,))
    cos, signed_sin = rotary(positions)
    rope = RopeInputs(positions, rotary.cos_cache, rotary.sin_cache, cos, signed_sin)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # not contiguous
    ours = CpuNativeLayerOps().rotate(qk, rope)
    torch.testing.assert_close(ours, TorchLayerOps().rotate(qk, rope), rtol=1e-6, atol=1e-6)
    assert ours.is_contiguous()


@pytest.mark.parametrize("tokens", [1, 4])
def test_silu_mul_equals_torch(tokens: int) -> None:
    gate_up = torch.randn(tokens, 2 * 1536) * 4
    expected = TorchLayerOps().silu_mul(gate_up.clone())  # silu in place on its input's gate half
    torch.testing.assert_close(CpuNativeLayerOps().silu_mul(gate_up), expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("inter", [13, 1536])
def test_silu_mul_over_the_whole_float_range(inter: int) -> None:
    """The vectorized exp (AVX2 builds) clamps its argument: gates far beyond +-88, zeros and a
    width that is not a multiple of 8 (the scalar tail) still give torch's silu(gate) * up."""
    torch.manual_seed(inter)
    gate = torch.cat([torch.linspace(-200, 200, 2 * inter), torch.randn(2 * inter) * 20])
    gate[::7] = 0.0
    gate_up = torch.cat([gate.view(4, inter), torch.randn(4, inter) * 3], dim=1).contiguous()
    expected = TorchLayerOps().silu_mul(gate_up.clone())
    ours = CpuNativeLayerOps().silu_mul(gate_up)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=1e-6)
