"""INT4 experts (W4A16: int32 words of 8 unsigned nibbles along K, a scale and a uint8 zero per
group of columns) in the fused MoE Triton kernels (kernels/triton/fused_moe.py, fused_moe_gemv.py) on
the CPU under TRITON_INTERPRET=1 at tiny shapes: on the few-token GEMV path and the grouped GEMMs,
groups of 32 / 64 / 128 columns and one group per row, asymmetric and symmetric (8) zeros, against a
float32 loop over experts on the dequantized weights (q - zero) * scale.

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

pytest.importorskip("triton")

from tests.moe_reference import assert_close_to_loop, distinct_routes, loop_over_experts  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton.fused_moe import (  # noqa: E402
    fused_moe,
    int4_plane_stages,
    int4_planes,
    routed_fused_moe,
    routed_fused_moe_from_residual,
    takes_residual,
    tiles_for_int4,
)
from tokenmill.kernels.triton.moe_int4_layout import pack_int4_experts  # noqa: E402
from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles, moe_tiles  # noqa: E402
from tokenmill.model.layers.moe import TorchMoEOps  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, timeout=300)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)

NUM_EXPERTS, TOP_K = 8, 2


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process interprets the kernels: the cases below ran here")
    INTERPRETED_RUN.assert_passes()


def _quantized(
    rows: int, cols: int, group: int | None, symmetric: bool, scale_dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int32 [E, rows, cols / 8], scales, uint8 zeros [E, rows, cols / G], the float32
    dequantized weights [E, rows, cols]) of random codes, for outputs of about unit size."""
    group = group or cols
    groups = cols // group
    q = torch.randint(0, 16, (NUM_EXPERTS, rows, cols), generator=gen)
    if symmetric:
        zeros = torch.full((NUM_EXPERTS, rows, groups), 8, dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 16, (NUM_EXPERTS, rows, groups), generator=gen).to(torch.uint8)
    # Group scales up to 8x apart, so that a scale or zero applied to the wrong group shows.
    scale = ((torch.rand(NUM_EXPERTS, rows, groups, generator=gen) * 1.75 + 0.25) * 0.25 / cols**0.5).to(
        scale_dtype
    )
    full_zeros = zeros.long().repeat_interleave(group, 2)
    dequantized = (q - full_zeros).float() * scale.float().repeat_interleave(group, 2)
    return pack_int4_experts(q, group), scale, zeros, dequantized


def _int4_experts(
    hidden: int, inter: int, group: int | None, symmetric: bool = False, seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, object], torch.Tensor, torch.Tensor]:  # fmt: skip
    """(fused_moe's weight arguments, gate/up dequantized, down dequantized)."""
    gen = torch.Generator().manual_seed(seed)
    w13, w13_scale, w13_zeros, gate_up = _quantized(2 * inter, hidden, group, symmetric, scale_dtype, gen)
    w2, w2_scale, w2_zeros, down = _quantized(hidden, inter, group, symmetric, scale_dtype, gen)
    args = {
        "w13": w13, "w2": w2, "w13_scale": w13_scale, "w2_scale": w2_scale, "w13_zeros": w13_zeros,
        "w2_zeros": w2_zeros, "group_size": group,
    }  # fmt: skip
    return args, gate_up, down


def _routes(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return distinct_routes(num_tokens, NUM_EXPERTS, TOP_K, seed)


def _call(x, weights, ids, args, tiles=None) -> torch.Tensor:
    return fused_moe(x, args["w13"], args["w2"], weights, ids, tiles, **_quant_kwargs(args))


def _quant_kwargs(args: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in args.items() if key not in ("w13", "w2")}


# -- against the dequantized loop -----------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize(
    ("num_tokens", "dtype", "hidden", "inter", "group", "symmetric", "method"),
    [
        (1, torch.float32, 64, 128, 32, False, "gemv"),  # one decode token; 2 groups a w13 row, 4 a w2 row
        (3, torch.bfloat16, 256, 128, 64, False, "gemv"),
        (3, torch.float32, 64, 128, None, True, "gemv"),  # one group per row (G = K), zeros 8
        (40, torch.bfloat16, 64, 128, 32, True, "grouped"),
        (40, torch.float32, 256, 256, 64, False, "grouped"),
        (40, torch.float32, 64, 128, None, False, "grouped"),  # G = H for w13, G = I for w2
    ],
)  # fmt: skip
def test_int4_experts_match_a_loop_over_the_dequantized_experts(
    num_tokens, dtype, hidden, inter, group, symmetric, method
):
    """The default tiles for this batch (the test checks which path they take); bf16 activations
    come with bf16 scales, float32 ones with float32 scales."""
    assert moe_tiles(NUM_EXPERTS, inter, hidden, dtype, num_tokens, TOP_K).method == method
    args, gate_up, down = _int4_experts(
        hidden, inter, group, symmetric, seed=num_tokens + hidden, scale_dtype=dtype
    )
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = _routes(num_tokens, seed=2)
    out = _call(x, weights, ids, args)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_to_loop(out, loop_over_experts(x, gate_up, down, weights, ids))


@interpreted_only
@pytest.mark.parametrize(
    "tiles",
    [
        # one pack an iteration (BLOCK_K <= 256: fused_moe_gemv.int4_packs_per_step)
        MoETiles(16, GemmTiles(32, 64), GemmTiles(16, 32), "gemv"),
        # gate/up block_k 256 over H 128: one masked K step spanning every group (EVEN_K off)
        MoETiles(16, GemmTiles(32, 256), GemmTiles(64, 16)),
    ],
    ids=["gemv", "grouped"],
)
@pytest.mark.parametrize("group", [32, 128], ids=["G32", "G128"])
def test_int4_experts_on_each_path_with_given_tiles(tiles, group):
    """Three tokens forced onto each path, bf16 activations with float32 scales (w13 [512, 128],
    w2 [128, 256]; G 128 is one group per w13 row)."""
    args, gate_up, down = _int4_experts(128, 256, group, seed=10)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(11)).bfloat16()
    weights, ids = _routes(3, seed=12)
    assert_close_to_loop(
        _call(x, weights, ids, args, tiles), loop_over_experts(x, gate_up, down, weights, ids)
    )


@interpreted_only
@pytest.mark.parametrize(
    ("hidden", "inter", "group", "gate_up_block_k", "down_block_k"),
    [
        # gate/up: 3 packs of 64 columns in steps of 2 (the last step half masked); down: 1 pack of 128
        # in a step of 4 (3 masked)
        (192, 128, 64, 512, 1024),
        (320, 192, 32, 1024, 512),  # 5 packs in steps of 4; down 3 packs in steps of 2; 2 groups a pack
        (128, 192, None, 512, 512),  # one group a row
    ],
)  # fmt: skip
def test_int4_gemvs_with_several_packs_a_step(hidden, inter, group, gate_up_block_k, down_block_k):
    """BLOCK_K above 256 makes the INT4 GEMVs load BLOCK_K / 256 packs an iteration (a [rows,
    packs, CHUNK] tile of words, fused_moe_gemv.int4_packs_per_step), masking packs past K, with
    each pack's groups as in one. Small K gives small packs (moe_int4_layout.int4_chunk), so these
    shapes have several."""
    args, gate_up, down = _int4_experts(hidden, inter, group, seed=30)
    tiles = MoETiles(16, GemmTiles(32, gate_up_block_k), GemmTiles(32, down_block_k), "gemv")
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(31)).bfloat16()
    weights, ids = _routes(3, seed=32)
    assert_close_to_loop(
        _call(x, weights, ids, args, tiles), loop_over_experts(x, gate_up, down, weights, ids)
    )


@interpreted_only
@pytest.mark.parametrize(
    ("method", "hidden", "inter", "tiles"),
    [
        ("gemv", 64, 128, MoETiles(16, GemmTiles(32, 32), GemmTiles(32, 64), "gemv")),
        # packs of 8 words (K 64): each K step gathers its weights
        ("grouped", 64, 64, MoETiles(16, GemmTiles(32, 32), GemmTiles(32, 64))),
        # packs of 16 / 32 words (K 128 / 256): one dot per nibble plane; the 16-bit kernels' block_k
        # is the plane's columns, so both sum the same columns in the same order
        ("grouped", 128, 256, MoETiles(16, GemmTiles(32, 16), GemmTiles(32, 32))),
        # 32 rows of pairs: the transposed dots (W^T x^T, INT4_TRANSPOSED_MIN_BLOCK_M)
        ("grouped", 128, 256, MoETiles(32, GemmTiles(32, 16), GemmTiles(32, 32))),
    ],
    ids=["gemv", "grouped-gather", "grouped-planes", "grouped-planes-transposed"],
)
def test_int4_experts_compute_the_16_bit_kernels_on_the_dequantized_weights(method, hidden, inter, tiles):
    """Bit for bit (under the interpreter, whose dot with an accumulator is the product plus the
    accumulator): the grouped GEMMs round the dequantized tile to x's dtype, as the 16-bit kernels
    read a bf16 checkpoint of it; the GEMVs keep it in float32, as they read float32 weights."""
    if method == "grouped":
        assert int4_planes(hidden, 32) == int4_planes(inter, 32) == (hidden >= 128)
    args, gate_up, down = _int4_experts(hidden, inter, 32, seed=20)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(21)).bfloat16()
    weights, ids = _routes(3, seed=22)
    if method == "grouped":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    assert torch.equal(_call(x, weights, ids, args, tiles), fused_moe(x, gate_up, down, weights, ids, tiles))


@interpreted_only
@pytest.mark.parametrize(
    ("method", "renormalize", "dtype"),
    [("gemv", True, torch.float32), ("gemv", False, torch.bfloat16), ("grouped", False, torch.bfloat16)],
)
def test_routed_fused_moe_with_int4_experts(method, renormalize, dtype):
    """Logits in, as the engine calls it (the GEMV path routes inside its gate/up launch): torch's
    routing, then the loop over the dequantized experts."""
    args, gate_up, down = _int4_experts(64, 128, 64, seed=30)
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    logits = (torch.randn(3, NUM_EXPERTS, generator=gen) * 2).to(dtype)
    tiles = MoETiles(16, GemmTiles(16, 64), GemmTiles(8, 128), method)
    round_weights = dtype != torch.float32
    out = routed_fused_moe(
        x, logits, args["w13"], args["w2"], TOP_K, renormalize, round_weights, tiles, **_quant_kwargs(args)
    )
    weights, ids = TorchMoEOps().route(logits, TOP_K, renormalize, round_weights)
    assert_close_to_loop(out, loop_over_experts(x, gate_up, down, weights.float(), ids))


@interpreted_only
@pytest.mark.parametrize("method", ["gemv", "grouped"])
def test_16_bit_experts_without_int4_arguments_are_unchanged(method):
    """The new arguments default to off: None passed explicitly changes nothing."""
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
        x, gate_up, down, weights, ids, tiles, w13_zeros=None, w2_zeros=None, group_size=None
    )
    assert torch.equal(out, explicit)


# -- checks (no kernel runs) ---------------------------------------------------------------------------


def _int4_call(hidden=64, inter=128, group=32, **overrides):
    """fused_moe's arguments for INT4 experts with valid scales and zeros, some replaced."""
    args, _, _ = _int4_experts(hidden, inter, group)
    weights, ids = _routes(2, seed=50)
    call = {"x": torch.zeros(2, hidden), "topk_weights": weights, "topk_ids": ids, **args}
    call.update(overrides)
    return call


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # E = 8, 2I = 256, H = 64, G = 32: w13 [8, 256, 8], scales and zeros [8, 256, 2]
        ({"w13": torch.zeros(8, 256, 64, dtype=torch.int32)}, r"int32 \[E, 2I, H / 8\].*\(8, 256, 8\)"),
        ({"w2": torch.zeros(8, 64, 128)}, "both w13 and w2 packed in int32; got w13 torch.int32, w2 torch.float32"),
        ({"x": torch.zeros(2, 60), "w13": torch.zeros(8, 256, 7, dtype=torch.int32)},
         "hidden size H = 60 to be a multiple of 8"),
        ({"w13_scale": torch.ones(8, 256, 4)}, r"w13_scale must be a \[8, 256, 2\] tensor .*got torch.float32 \[8, 256, 4\]"),
        ({"w2_scale": torch.ones(8, 64, 4, dtype=torch.float64)}, "w2_scale must be .* or float32.*torch.float64"),
        ({"x": torch.zeros(2, 64).bfloat16(), "w2_scale": torch.ones(8, 64, 4, dtype=torch.float16)},
         "x's dtype torch.bfloat16 or float32.*torch.float16"),
        ({"w13_zeros": torch.zeros(8, 256, 2, dtype=torch.int32)}, r"w13_zeros must be a uint8 \[8, 256, 2\].*torch.int32"),
        ({"w2_zeros": torch.zeros(8, 64, 2, dtype=torch.uint8)}, r"w2_zeros must be a uint8 \[8, 64, 4\]"),
        ({"w2_zeros": None}, "w13_zeros and w2_zeros; missing w2_zeros"),
        ({"w13_scale": None, "w2_scale": None}, "missing w13_scale, w2_scale"),
        ({"group_size": 48}, "group_size must be a multiple of 8 dividing the hidden size H = 64 and the intermediate size I = 128"),
        ({"group_size": 12}, "group_size must be a multiple of 8"),
        ({"scale_block": (128, 128)}, "INT4 experts take group_size, got scale_block"),
        ({"x": torch.zeros(2, 64, dtype=torch.float64)}, "activations; got x torch.float64"),
        ({"gate_up_bias": torch.zeros(8, 256)}, "INT4 experts .* biases or clamped SwiGLU are not supported"),
        ({"clamped_swiglu": (1.702, 7.0)}, "INT4 experts .* biases or clamped SwiGLU are not supported"),
        ({"w13": torch.zeros(8, 256, 64), "w2": torch.zeros(8, 64, 128)},
         "w13_zeros, w2_zeros and group_size go with INT4 experts"),
    ],
)  # fmt: skip
def test_bad_int4_arguments_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        fused_moe(**_int4_call(**overrides))


def test_int4_shapes_must_divide_by_8_and_the_group():
    with pytest.raises(ValueError, match="intermediate size I = 100 to be a multiple of 8"):
        fused_moe(
            **_int4_call(
                w13=torch.zeros(8, 200, 8, dtype=torch.int32), w2=torch.zeros(8, 64, 12, dtype=torch.int32)
            )
        )
    with pytest.raises(ValueError, match="H = 64 and the intermediate size I = 128 .*got 128"):
        fused_moe(**_int4_call(group_size=128))  # divides I, not H


def test_routed_fused_moe_checks_int4_arguments_too():
    args = _int4_call(w2_zeros=torch.zeros(NUM_EXPERTS, 64, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"w2_zeros must be a uint8 \[8, 64, 4\]"):
        routed_fused_moe(
            args["x"], torch.zeros(2, NUM_EXPERTS), args["w13"], args["w2"], TOP_K, True, False,
            **_quant_kwargs({k: v for k, v in args.items() if k not in ("x", "topk_weights", "topk_ids")}),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("block_m", "asked", "stages"), [(128, 4, 2), (64, 3, 2), (32, 5, 3), (16, 2, 2), (16, 1, 1)]
)
def test_int4_plane_stages(block_m, asked, stages):
    """At most 2 from 64 rows up (3 ran out of shared memory at 128 x 128 tiles on an H200), 3 below."""
    assert int4_plane_stages(GemmTiles(128, 64, num_stages=asked), block_m) == stages


def test_grouped_int4_tiles_take_the_plane_path_where_packs_are_16_words():
    """Qwen3-30B-A3B's experts (H 2048, I 768, groups of 128): both GEMMs on the plane path, their
    stages from int4_plane_stages; K 64 gathers (block_k at most 64, one stage)."""
    big = MoETiles(128, GemmTiles(128, 64, num_stages=4), GemmTiles(128, 64, num_stages=3))
    tiles = tiles_for_int4(big, 4096, hidden=2048, inter=768, group_size=128)
    assert int4_planes(2048, 128) and int4_planes(768, 128)
    assert tiles.gate_up == GemmTiles(128, 64, num_stages=2) and tiles.down == GemmTiles(
        128, 64, num_stages=2
    )
    small = MoETiles(16, GemmTiles(32, 128, num_stages=4), GemmTiles(32, 128, num_stages=4))
    tiles = tiles_for_int4(small, 40, hidden=64, inter=128, group_size=32)
    assert not int4_planes(64, 32)
    assert tiles.gate_up == GemmTiles(32, 64, num_stages=1)
    assert tiles.down == GemmTiles(32, 128, num_stages=3)  # I 128: packs of 16 words


def test_int4_experts_never_take_the_deferred_norm():
    args = _int4_call()
    w13, w2 = args["w13"], args["w2"]
    assert moe_tiles(NUM_EXPERTS, 128, 64, torch.bfloat16, 1, TOP_K).method == "gemv"
    assert takes_residual(1, torch.zeros(8, 256, 64).bfloat16(), torch.zeros(8, 64, 128).bfloat16(), TOP_K)
    assert not takes_residual(1, w13, w2, TOP_K)
    with pytest.raises(ValueError, match="deferred norm takes 16/32-bit experts, not int32"):
        routed_fused_moe_from_residual(
            args["x"], torch.zeros(2, NUM_EXPERTS), w13, w2, TOP_K, True, False, 1e-6
        )


@interpreted_only
@pytest.mark.parametrize(("method", "num_tokens"), [("awq", 1), ("gptq", 40)])
def test_a_moe_block_with_4bit_experts_runs_them_through_the_kernels(method, num_tokens):
    """The model wiring (layers/moe.py, moe_int4.py): a SparseMoEBlock whose experts are rounded to
    4-bit groups at load as a GPU keeps them (packed words + Int4ExpertScales into TritonMoEOps)
    against the same block dequantized on the torch ops (the CPU's path), same weights and inputs."""
    from tokenmill.model.layers.layer_ops import select_layer_ops
    from tokenmill.model.layers.moe import SparseMoEBlock, TritonMoEOps
    from tokenmill.model.layers.moe_int4 import Int4ExpertWeights
    from tokenmill.model.loader.quant_config import at_load_quantization
    from tokenmill.model.moe_config import MoEConfig

    hidden, inter = 128, 128  # groups of 128
    moe = MoEConfig(NUM_EXPERTS, TOP_K, inter, renormalize=True, sparse_layers=(0,))
    spec = at_load_quantization(method)
    gen = torch.Generator().manual_seed(num_tokens)
    router = torch.randn((NUM_EXPERTS, hidden), generator=gen) * 0.2
    w13 = torch.randn((NUM_EXPERTS, 2 * inter, hidden), generator=gen) * 0.1
    w2 = torch.randn((NUM_EXPERTS, hidden, inter), generator=gen) * 0.1
    blocks = []
    for ops, use_kernels in ((TritonMoEOps(), True), (TorchMoEOps(), False)):
        block = SparseMoEBlock(
            hidden,
            moe,
            select_layer_ops("cpu"),
            ops,
            expert_quant=Int4ExpertWeights(spec, use_kernels=use_kernels),
        )
        block.gate.weight.data.copy_(router)
        block.experts.weight_loader("gate_up_proj", w13)
        block.experts.weight_loader("down_proj", w2)
        block.experts.process_weights_after_loading()
        blocks.append(block)
    kernels, reference = blocks
    assert kernels.experts.gate_up_proj.dtype == torch.int32 and kernels.experts.scales is not None
    assert reference.experts.gate_up_proj.dtype == torch.float32 and reference.experts.scales is None
    x = torch.randn((num_tokens, hidden), generator=gen)
    torch.testing.assert_close(kernels(x), reference(x), atol=1e-5, rtol=1e-4)
