"""Gemma's elementwise Triton launches on the CPU under TRITON_INTERPRET=1, against transformers'
formulas: the norm whose float32 weight (Gemma's 1 + w) multiplies before the one rounding, and
GeGLU's gelu(gate, tanh approximation) * up. The PyTorch ops (layers/layer_ops.py) give the same.

Like tests/unit/test_triton_attention.py: the variable must be set before triton is first
imported; if this process imported it compiled, a subprocess runs this file interpreted.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.model.layers.layer_ops import TorchLayerOps  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)
# One ulp of the output dtype (relative), plus an absolute floor for values near zero.
ONE_ULP = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-6}}


def _gemma_rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma2RMSNorm.forward, written out."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + w.float())).type_as(x)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_with_a_float32_weight_rounds_once_like_gemma(dtype: torch.dtype) -> None:
    from tokenmill.kernels.triton.elementwise import add_rms_norm

    gen = torch.Generator().manual_seed(0)
    rows, hidden, eps = 5, 48, 1e-6
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(hidden, generator=gen) * 0.5).to(dtype)  # the checkpoint's w
    scale = 1.0 + w.float()  # what GemmaRMSNorm holds
    summed = x + delta  # rounded to dtype, as transformers' residual add is
    expected = _gemma_rms_norm_reference(summed, w, eps)

    residual = x.clone()
    out = add_rms_norm(residual, scale, eps, delta, weight_in_float32=True)
    assert torch.equal(residual, summed)  # the residual stream holds the rounded sum
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **ONE_ULP[dtype])
    # Without a delta it is the plain norm (Gemma's post-attention / post-feed-forward norms).
    torch.testing.assert_close(
        add_rms_norm(summed.clone(), scale, eps, weight_in_float32=True), expected, **ONE_ULP[dtype]
    )
    # The CPU ops: the same rounding order.
    cpu = TorchLayerOps().add_rms_norm(x.clone(), scale, eps, delta, weight_in_float32=True)
    torch.testing.assert_close(cpu, expected, **ONE_ULP[dtype])
    if dtype == torch.bfloat16:
        # Llama's order (round, then multiply by a rounded weight) gives other values here: the
        # flag is what makes the difference.
        llama_order = add_rms_norm(x.clone(), scale.to(dtype), eps, delta)
        assert not torch.equal(llama_order, expected)
    with pytest.raises(ValueError, match="float32 weight"):
        add_rms_norm(x.clone(), scale.to(torch.float16), eps, weight_in_float32=True)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_equals_pytorch_geglu(dtype: torch.dtype) -> None:
    from tokenmill.kernels.triton.elementwise import gelu_tanh_mul

    gen = torch.Generator().manual_seed(1)
    rows, intermediate = 6, 80  # not a power of two: the masked tail of a block
    gate_up = (torch.randn(rows, 2 * intermediate, generator=gen) * 4).to(dtype)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    expected = F.gelu(gate, approximate="tanh") * up  # transformers' GELUTanh, then the multiply
    out = gelu_tanh_mul(gate_up)
    assert out.shape == (rows, intermediate) and out.dtype == dtype
    # The kernel's gelu (g * sigmoid(2y), not 1 + tanh(y)) differs from PyTorch's in the last float32
    # bits (PyTorch's 1 + tanh cancels for very negative gates); in bf16 the interpreter's store
    # truncates where a GPU rounds to nearest (tests/gpu/test_gemma_gpu.py checks the rounding), so
    # a value may land one ulp off, and the activation's one ulp may become two after the multiply.
    two_ulps = {"rtol": 2 * ONE_ULP[dtype]["rtol"], "atol": ONE_ULP[dtype]["atol"]}
    torch.testing.assert_close(out, expected, **two_ulps)
    torch.testing.assert_close(TorchLayerOps().gelu_tanh_mul(gate_up), expected, rtol=0, atol=0)


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process runs the cases interpreted itself")
    INTERPRETED_RUN.assert_passes()
