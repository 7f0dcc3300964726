"""FP8 (e4m3) experts with float32 scales (W8A16) in the fused MoE Triton kernels
(kernels/triton/fused_moe.py, fused_moe_gemv.py) on the CPU under TRITON_INTERPRET=1 at tiny
shapes: per-row and 128x128-block scales, on the few-token GEMV path and the grouped GEMMs, against
a float32 loop over experts on the dequantized weights (q * scale).

As in test_fused_moe_triton.py: the variable must be set before triton is first imported; if this
process imported triton compiled, the kernel cases are skipped and one test reruns this file in an
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
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tests.moe_reference import assert_close_to_loop, distinct_routes, loop_over_experts  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton.fused_moe import (  # noqa: E402
    fused_moe,
    routed_fused_moe,
    routed_fused_moe_from_residual,
    takes_residual,
    tiles_within_scale_block,
)
from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles, moe_tiles  # noqa: E402
from tokenmill.model.layers.moe import TorchMoEOps  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, timeout=300)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)

NUM_EXPERTS, TOP_K = 8, 2
BLOCK = (128, 128)


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process interprets the kernels: the cases below ran here")
    INTERPRETED_RUN.assert_passes()


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """The scale of every weight element: [E, rows, cols]."""
    if block is None:
        return scale[:, :, None].expand(-1, rows, cols)
    return scale.repeat_interleave(block[0], 1)[:, :rows].repeat_interleave(block[1], 2)[:, :, :cols]


def _quantize(
    w: torch.Tensor, block: tuple[int, int] | None, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weights, float32 scales, the dequantized weights q.float() * scale) of w [E, N, K],
    each scale the amax of its row or block over e4m3's 448 (rounded up to a power of two with
    `power_of_two`, so the dequantized weights are exact in bfloat16 too)."""
    num_experts, rows, cols = w.shape
    if block is None:
        amax = w.abs().amax(dim=2)
    else:
        bn, bk = block
        padded = F.pad(w.abs(), (0, -cols % bk, 0, -rows % bn))
        amax = padded.view(num_experts, padded.shape[1] // bn, bn, padded.shape[2] // bk, bk).amax(dim=(2, 4))
    scale = amax.clamp_min(1e-6) / 448
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = _expand(scale, rows, cols, block)
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.float(), q.float() * full


def _fp8_experts(
    hidden: int, inter: int, block: tuple[int, int] | None, seed: int, power_of_two: bool = False
):
    """(w13, w13_scale, w13 dequantized, w2, w2_scale, w2 dequantized) for NUM_EXPERTS experts."""
    gen = torch.Generator().manual_seed(seed)
    # Outputs of about unit size; rows and columns of magnitudes 8x apart, so that a scale
    # applied to the wrong row or block shows.
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) / inter**0.5
    w13 *= torch.rand(NUM_EXPERTS, 2 * inter, 1, generator=gen) * 1.75 + 0.25
    w2 *= torch.rand(NUM_EXPERTS, 1, inter, generator=gen) * 1.75 + 0.25
    return (*_quantize(w13, block, power_of_two), *_quantize(w2, block, power_of_two))


def _routes(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return distinct_routes(num_tokens, NUM_EXPERTS, TOP_K, seed)


# -- against the dequantized loop -----------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize(
    ("num_tokens", "dtype", "block", "hidden", "inter", "method"),
    [
        (1, torch.float32, None, 64, 128, "gemv"),  # one decode token, per-row scales
        (3, torch.bfloat16, BLOCK, 256, 128, "gemv"),  # w13: 2x2 scale blocks, w2: 2x1
        (3, torch.float32, BLOCK, 192, 128, "gemv"),  # H 192: the last K block of w13 is half full
        (40, torch.bfloat16, None, 64, 128, "grouped"),
        (40, torch.float32, BLOCK, 256, 256, "grouped"),
        (40, torch.float32, BLOCK, 192, 128, "grouped"),  # partial K block; w2's last row block too
    ],
)  # fmt: skip
def test_fp8_experts_match_a_loop_over_the_dequantized_experts(
    num_tokens, dtype, block, hidden, inter, method
):
    """The default tiles for this batch (the test checks which path they take): the GEMV ones
    have block_k 256 / 512, clamped to the 128-column scale blocks."""
    assert moe_tiles(NUM_EXPERTS, inter, hidden, dtype, num_tokens, TOP_K).method == method
    w13, w13_scale, gate_up, w2, w2_scale, down = _fp8_experts(hidden, inter, block, seed=num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = _routes(num_tokens, seed=2)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, scale_block=block)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_loop(out, loop_over_experts(x, gate_up, down, weights, ids))


@interpreted_only
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-row", "block"])
@pytest.mark.parametrize(
    "tiles",
    [
        MoETiles(16, GemmTiles(32, 64), GemmTiles(16, 32), "gemv"),  # two to four K steps per scale block
        MoETiles(16, GemmTiles(32, 256), GemmTiles(64, 32)),  # gate/up block_k 256: clamped in block mode
    ],
    ids=["gemv", "grouped"],
)
def test_fp8_experts_on_each_path_with_given_tiles(tiles, block):
    """Three tokens forced onto each path with tiles whose K steps are smaller or larger than the
    scale blocks (w13 [512, 128]: 4x1 scale blocks, w2 [128, 256]: 1x2)."""
    w13, w13_scale, gate_up, w2, w2_scale, down = _fp8_experts(128, 256, block, seed=10)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(11))
    weights, ids = _routes(3, seed=12)
    out = fused_moe(
        x, w13, w2, weights, ids, tiles, w13_scale=w13_scale, w2_scale=w2_scale, scale_block=block
    )
    assert_close_to_loop(out, loop_over_experts(x, gate_up, down, weights, ids))


@interpreted_only
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-row", "block"])
@pytest.mark.parametrize(
    "tiles",
    [
        MoETiles(16, GemmTiles(32, 64), GemmTiles(32, 64), "gemv"),
        MoETiles(16, GemmTiles(32, 64), GemmTiles(32, 64)),
    ],
    ids=["gemv", "grouped"],
)
def test_fp8_experts_round_as_the_16_bit_path_on_the_dequantized_weights(tiles, block):
    """Power-of-two scales make the dequantized weights exact in bf16 and every scale multiply
    exact, so the FP8 launches give the 16-bit launches' output on those weights bit for bit
    (under the interpreter, whose dot with an accumulator is the product plus the accumulator):
    the same rounding of gate/up, the activation and the output."""
    w13, w13_scale, gate_up, w2, w2_scale, down = _fp8_experts(256, 128, block, seed=20, power_of_two=True)
    assert torch.equal(gate_up.bfloat16().float(), gate_up) and torch.equal(down.bfloat16().float(), down)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(21)).bfloat16()
    weights, ids = _routes(3, seed=22)
    out = fused_moe(
        x, w13, w2, weights, ids, tiles, w13_scale=w13_scale, w2_scale=w2_scale, scale_block=block
    )
    assert torch.equal(out, fused_moe(x, gate_up.bfloat16(), down.bfloat16(), weights, ids, tiles))


@interpreted_only
@pytest.mark.parametrize(
    ("method", "block", "renormalize", "dtype"),
    [
        ("gemv", BLOCK, True, torch.float32),
        ("gemv", None, False, torch.bfloat16),
        ("grouped", BLOCK, False, torch.bfloat16),
    ],
)
def test_routed_fused_moe_with_fp8_experts(method, block, renormalize, dtype):
    """Logits in, as the engine calls it (the GEMV path routes inside its gate/up launch): torch's
    routing, then the loop over the dequantized experts."""
    w13, w13_scale, gate_up, w2, w2_scale, down = _fp8_experts(128, 128, block, seed=30)
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(3, 128, generator=gen).to(dtype)
    logits = (torch.randn(3, NUM_EXPERTS, generator=gen) * 2).to(dtype)
    tiles = MoETiles(16, GemmTiles(16, 64), GemmTiles(8, 128), method)
    round_weights = dtype != torch.float32
    out = routed_fused_moe(
        x, logits, w13, w2, TOP_K, renormalize, round_weights, tiles, w13_scale=w13_scale, w2_scale=w2_scale,
        scale_block=block,
    )  # fmt: skip
    weights, ids = TorchMoEOps().route(logits, TOP_K, renormalize, round_weights)
    assert_close_to_loop(out, loop_over_experts(x, gate_up, down, weights.float(), ids))


@interpreted_only
@pytest.mark.parametrize("method", ["gemv", "grouped"])
def test_16_bit_experts_without_scales_are_unchanged(method):
    """No scales: the 16-bit kernels as before (the new arguments default to off) - the existing
    tolerance against the float32 loop, and None scales passed explicitly change nothing."""
    gen = torch.Generator().manual_seed(40)
    gate_up = (torch.randn(NUM_EXPERTS, 96, 64, generator=gen) * 0.15).bfloat16()
    down = (torch.randn(NUM_EXPERTS, 64, 48, generator=gen) * 0.15).bfloat16()
    x = torch.randn(3, 64, generator=gen).bfloat16()
    weights, ids = _routes(3, seed=41)
    tiles = MoETiles(16, GemmTiles(16, 32), GemmTiles(16, 16), method)
    out = fused_moe(x, gate_up, down, weights, ids, tiles)
    torch.testing.assert_close(
        out.float(), loop_over_experts(x, gate_up, down, weights, ids), atol=2e-2, rtol=2e-2
    )
    explicit = fused_moe(
        x, gate_up, down, weights, ids, tiles, w13_scale=None, w2_scale=None, scale_block=None
    )
    assert torch.equal(out, explicit)


# -- checks (no kernel runs) ---------------------------------------------------------------------------


def _fp8_call(hidden=64, inter=128, block=None, **overrides):
    """fused_moe's arguments for FP8 experts with valid scales, some replaced by `overrides`."""
    w13 = torch.zeros(NUM_EXPERTS, 2 * inter, hidden, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(NUM_EXPERTS, hidden, inter, dtype=torch.float8_e4m3fn)
    if block is None:
        w13_scale, w2_scale = torch.ones(NUM_EXPERTS, 2 * inter), torch.ones(NUM_EXPERTS, hidden)
    else:
        bn, bk = block
        w13_scale = torch.ones(NUM_EXPERTS, -(-2 * inter // bn), -(-hidden // bk))
        w2_scale = torch.ones(NUM_EXPERTS, -(-hidden // bn), -(-inter // bk))
    weights, ids = _routes(2, seed=50)
    args = {
        "x": torch.zeros(2, hidden), "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids,
        "w13_scale": w13_scale, "w2_scale": w2_scale, "scale_block": block,
    }  # fmt: skip
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # per-row scales of the wrong shape or dtype (E = 8, 2I = 256, H = 64)
        ({"w13_scale": torch.ones(8, 128)}, r"w13_scale must be a float32 \[8, 256\] .*\[8, 128\]"),
        ({"w2_scale": torch.ones(8, 64, dtype=torch.float64)}, r"w2_scale must be a float32 .*torch.float64"),
        # block scales: cdiv(256, 128) x cdiv(64, 128) = 2 x 1 for w13
        ({"block": BLOCK, "w13_scale": torch.ones(8, 2, 2)}, r"w13_scale must be a float32 \[8, 2, 1\]"),
        ({"w13": torch.zeros(8, 256, 64, dtype=torch.bfloat16)}, "e4m3fn weights; got w13 torch.bfloat16"),
        ({"w13_scale": None, "w2_scale": None}, "need w13_scale and w2_scale"),
        ({"w2_scale": None}, "both w13_scale and w2_scale; got only w13_scale"),
        ({"w13_scale": None, "w2_scale": None, "scale_block": BLOCK, "w13": torch.zeros(8, 256, 64),
          "w2": torch.zeros(8, 64, 128)}, "scale_block .* needs w13_scale"),
        ({"inter": 96, "block": BLOCK}, r"size I = 96 .* multiple of the scale block's 128 rows"),
        ({"block": (128, 100)}, "powers of 2 >= 16"),
        ({"block": (8, 128)}, "powers of 2 >= 16"),
        ({"x": torch.zeros(2, 64, dtype=torch.float64)}, "activations; got x torch.float64"),
        ({"gate_up_bias": torch.zeros(8, 256)}, "biases or clamped SwiGLU are not supported"),
    ],
)  # fmt: skip
def test_bad_fp8_arguments_are_refused(overrides, message):
    overrides = dict(overrides)  # the parameter is shared: leave it as it was
    sizes = {key: overrides.pop(key) for key in ("hidden", "inter", "block") if key in overrides}
    with pytest.raises(ValueError, match=message):
        fused_moe(**_fp8_call(**sizes, **overrides))


def test_routed_fused_moe_checks_the_scales_too():
    args = _fp8_call(w2_scale=torch.ones(NUM_EXPERTS, 65))
    with pytest.raises(ValueError, match=r"w2_scale must be a float32 \[8, 64\]"):
        routed_fused_moe(
            args["x"], torch.zeros(2, NUM_EXPERTS), args["w13"], args["w2"], TOP_K, True, False,
            w13_scale=args["w13_scale"], w2_scale=args["w2_scale"],
        )  # fmt: skip


def test_fp8_experts_never_take_the_deferred_norm():
    args = _fp8_call()
    w13, w2 = args["w13"], args["w2"]
    assert moe_tiles(NUM_EXPERTS, 128, 64, torch.bfloat16, 1, TOP_K).method == "gemv"
    assert takes_residual(1, w13.bfloat16(), w2.bfloat16(), TOP_K)
    assert not takes_residual(1, w13, w2, TOP_K)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        routed_fused_moe_from_residual(
            args["x"], torch.zeros(2, NUM_EXPERTS), w13, w2, TOP_K, True, False, 1e-6
        )


def test_tiles_within_scale_block_clamp_block_k_only():
    tiles = MoETiles(16, GemmTiles(4, 512, 1, 4, 2), GemmTiles(64, 64, 8, 4, 3), "gemv")
    assert tiles_within_scale_block(tiles, None) is tiles
    clamped = tiles_within_scale_block(tiles, (128, 128))
    assert clamped == MoETiles(16, GemmTiles(4, 128, 1, 4, 2), GemmTiles(64, 64, 8, 4, 3), "gemv")


@interpreted_only
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_a_moe_block_with_fp8_experts_runs_them_through_the_kernels(num_tokens):
    """The model wiring (layers/moe.py, moe_fp8.py): a SparseMoEBlock whose experts are quantized at
    load as a GPU would keep them (e4m3 + ExpertScales into TritonMoEOps) against the same block
    dequantized on the torch ops (the CPU's path), same weights and inputs."""
    from tokenmill.model.layers.layer_ops import select_layer_ops
    from tokenmill.model.layers.moe import SparseMoEBlock, TritonMoEOps
    from tokenmill.model.layers.moe_fp8 import Fp8ExpertWeights
    from tokenmill.model.loader.quant_config import at_load_quantization
    from tokenmill.model.moe_config import MoEConfig

    hidden, inter = 64, 128
    moe = MoEConfig(NUM_EXPERTS, TOP_K, inter, renormalize=True, sparse_layers=(0,))
    spec = at_load_quantization("fp8")
    gen = torch.Generator().manual_seed(num_tokens)
    router = torch.randn((NUM_EXPERTS, hidden), generator=gen) * 0.2
    w13 = torch.randn((NUM_EXPERTS, 2 * inter, hidden), generator=gen) * 0.1
    w2 = torch.randn((NUM_EXPERTS, hidden, inter), generator=gen) * 0.1
    blocks = []
    for ops, use_kernels in ((TritonMoEOps(), True), (TorchMoEOps(), False)):
        block = SparseMoEBlock(
            hidden, moe, select_layer_ops("cpu"), ops, expert_quant=Fp8ExpertWeights(spec, use_kernels=use_kernels)
        )
        block.gate.weight.data.copy_(router)
        block.experts.weight_loader("gate_up_proj", w13)
        block.experts.weight_loader("down_proj", w2)
        block.experts.process_weights_after_loading()
        blocks.append(block)
    kernels, reference = blocks
    assert kernels.experts.gate_up_proj.dtype == torch.float8_e4m3fn and kernels.experts.scales is not None
    assert reference.experts.gate_up_proj.dtype == torch.float32 and reference.experts.scales is None
    x = torch.randn((num_tokens, hidden), generator=gen)
    torch.testing.assert_close(kernels(x), reference(x), atol=1e-5, rtol=1e-4)
