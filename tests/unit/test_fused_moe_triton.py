"""The fused MoE Triton kernels (kernels/triton/fused_moe.py, moe_align.py, moe_routing.py) on
the CPU under TRITON_INTERPRET=1 at tiny shapes, against a loop over experts in torch; and the
whole CUDA-path MoE block (TritonMoEOps) inside the tiny MoE models against transformers.

As in test_triton_attention.py: the variable must be set before triton is first imported; if
this process imported triton compiled, the cases are skipped and one test reruns this file in
an interpreter subprocess.
"""

from __future__ import annotations

import json
import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tests import moe_checkpoints  # noqa: E402
from tests.model.test_model_forward import PagedHarness, _hf_logits, _load, _prompt  # noqa: E402
from tests.moe_reference import loop_over_experts  # noqa: E402
from tests.moe_shards import sharded_moe_blocks  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.kernels.triton import moe_align, moe_tile_configs  # noqa: E402
from tokenmill.kernels.triton.fused_moe import fused_moe  # noqa: E402
from tokenmill.kernels.triton.moe_align import align_by_sort, align_small  # noqa: E402
from tokenmill.kernels.triton.moe_routing import topk_softmax  # noqa: E402
from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles, default_tiles, moe_tiles  # noqa: E402
from tokenmill.model.layers.moe import SparseMoEBlock, TorchMoEOps, TritonMoEOps  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, timeout=600)  # run by the subprocess test below

tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process interprets the kernels: the cases below ran here")
    INTERPRETED_RUN.assert_passes()


def _routes(num_tokens: int, num_experts: int, top_k: int, seed: int, skip: tuple[int, ...] = ()) -> torch.Tensor:
    """[T, top_k] distinct experts per token, never one of `skip` (experts that get no pairs)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(num_tokens)])


# -- align ----------------------------------------------------------------------------------------------


def _check_blocks(blocks, ids: torch.Tensor, num_experts: int) -> None:
    """Every pair exactly once, in a block of its own expert, in pair order within the expert;
    each expert's run padded to block_m with the sentinel; num_padded = the used rows."""
    flat = ids.reshape(-1)
    num_pairs, block_m = flat.numel(), blocks.block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    used = int(padded.sum())
    assert int(blocks.num_padded[0]) == used
    assert blocks.sorted_pair_ids.numel() == blocks.max_blocks * block_m >= used
    rows = blocks.sorted_pair_ids[:used].long()
    assert (blocks.sorted_pair_ids[used:] == num_pairs).all()
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    start = 0
    for expert in range(num_experts):
        run = rows[start : start + int(padded[expert])]
        assert (run[: int(counts[expert])] == torch.nonzero(flat == expert).flatten()).all()
        assert (run[int(counts[expert]) :] == num_pairs).all()
        for b in range(start // block_m, (start + int(padded[expert])) // block_m):
            assert int(blocks.block_expert_ids[b]) == expert
        start += int(padded[expert])


@interpreted_only
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m", "skip"),
    [
        (1, 8, 2, 16, ()),  # one decode token
        (13, 8, 2, 16, (3,)),  # 26 pairs, not a multiple of the block; expert 3 gets none
        (7, 6, 3, 32, (0, 5)),  # top-3; the first and last experts get none
        (40, 128, 8, 16, ()),  # 320 pairs over 128 experts: several 32-pair chunks of the loop
        (5, 60, 4, 64, (59,)),  # a non-power-of-two expert count
    ],
)
def test_align_small_and_align_by_sort_give_the_same_valid_blocks(num_tokens, num_experts, top_k, block_m, skip):
    ids = _routes(num_tokens, num_experts, top_k, seed=num_tokens, skip=skip)
    small = align_small(ids.to(torch.int32), num_experts, block_m)
    by_sort = align_by_sort(ids, num_experts, block_m)
    _check_blocks(by_sort, ids, num_experts)
    _check_blocks(small, ids, num_experts)
    assert torch.equal(small.sorted_pair_ids, by_sort.sorted_pair_ids)
    used_blocks = int(small.num_padded[0]) // block_m
    assert torch.equal(small.block_expert_ids[:used_blocks], by_sort.block_expert_ids[:used_blocks])


# -- routing --------------------------------------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize(
    ("num_experts", "top_k", "renormalize", "dtype"),
    [(8, 2, True, torch.float32), (60, 4, False, torch.bfloat16), (128, 8, True, torch.bfloat16), (6, 1, False, torch.float32),
     (160, 6, True, torch.float32)],  # float32: bf16 ties order as torch.topk does not
)  # fmt: skip
def test_topk_softmax_matches_torch_routing(num_experts, top_k, renormalize, dtype):
    logits = (torch.randn(11, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2).to(dtype)
    weights, ids = topk_softmax(logits, top_k, renormalize, round_to_logits_dtype=dtype != torch.float32)
    expected_weights, expected_ids = TorchMoEOps().route(logits, top_k, renormalize, dtype != torch.float32)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights.float(), atol=1e-6, rtol=1e-6)
    if renormalize and dtype == torch.float32:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))


@interpreted_only
@pytest.mark.parametrize("num_experts", [8, 160])
def test_topk_softmax_ties_go_to_the_lower_expert_id(num_experts):
    logits = torch.zeros(2, num_experts)
    logits[1, [3, 5, 6]] = 1.0  # three tied leaders, then all the rest tied
    weights, ids = topk_softmax(logits, 4, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 5, 6, 0]]
    assert torch.equal(weights[0], torch.full((4,), 1 / num_experts))


# -- the grouped GEMMs ----------------------------------------------------------------------------------


def _expert_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.15
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.15
    return gate_up.to(dtype), down.to(dtype)


@interpreted_only
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "tiles", "skip"),
    [
        # 13 tokens: 26 pairs, not a multiple of the 16-row block; expert 2 gets no pairs.
        (13, 8, 2, 64, 48, MoETiles(16, GemmTiles(32, 32, 4), GemmTiles(32, 32, 4)), (2,)),
        # top-3, hidden 80 and inter 40: K not a multiple of BLOCK_K, N not of BLOCK_N.
        (9, 6, 3, 80, 40, MoETiles(16, GemmTiles(32, 32, 1), GemmTiles(64, 16, 2)), (0,)),
        # top-1 (no sum over k) and one decode token.
        (1, 4, 1, 32, 32, MoETiles(16, GemmTiles(16, 16, 1), GemmTiles(16, 16, 1)), ()),
        # 32-row blocks: a few experts half full.
        (21, 8, 2, 32, 32, MoETiles(32, GemmTiles(32, 32, 8), GemmTiles(32, 32, 8)), (5, 6)),
    ],
)
def test_fused_moe_matches_a_loop_over_experts_in_float32(num_tokens, num_experts, top_k, hidden, inter, tiles, skip):
    gate_up, down = _expert_weights(num_experts, hidden, inter, torch.float32, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    ids = _routes(num_tokens, num_experts, top_k, seed=2, skip=skip).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(3))
    out = fused_moe(x, gate_up, down, weights, ids, tiles)
    expected = loop_over_experts(x, gate_up, down, weights, ids.long())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(TorchMoEOps().experts(x, gate_up, down, weights, ids.long()), expected, atol=1e-5, rtol=1e-5)


@interpreted_only
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "tiles"),
    [
        (1, 8, 2, 64, 48, MoETiles(16, GemmTiles(4, 32), GemmTiles(8, 16), "gemv")),
        # ragged: hidden 80 over 32-wide K slices, inter 40 over 16-row column blocks; top-3
        (3, 6, 3, 80, 40, MoETiles(16, GemmTiles(16, 32), GemmTiles(2, 64), "gemv")),
        (2, 4, 1, 32, 32, MoETiles(16, GemmTiles(1, 64), GemmTiles(4, 32), "gemv")),
    ],
)
def test_gemv_path_matches_a_loop_over_experts(num_tokens, num_experts, top_k, hidden, inter, tiles):
    """The few-token path (fused_moe_gemv.py): per-pair gate/up GEMVs, per-token down GEMVs summing
    the k experts in registers."""
    gate_up, down = _expert_weights(num_experts, hidden, inter, torch.float32, seed=num_tokens + 20)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(21))
    ids = _routes(num_tokens, num_experts, top_k, seed=22).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(23))
    out = fused_moe(x, gate_up, down, weights, ids, tiles)
    torch.testing.assert_close(out, loop_over_experts(x, gate_up, down, weights, ids.long()), atol=1e-5, rtol=1e-5)
    bf16 = fused_moe(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), weights, ids, tiles)
    expected = loop_over_experts(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), weights, ids.long())
    torch.testing.assert_close(bf16.float(), expected, atol=2e-2, rtol=2e-2)


@interpreted_only
@pytest.mark.parametrize("method", ["gemv", "grouped"])
@pytest.mark.parametrize(("renormalize", "dtype"), [(True, torch.float32), (False, torch.bfloat16)])
def test_routed_fused_moe_matches_torch_routing_and_experts(method, renormalize, dtype):
    """Logits in, output out, as the engine calls it (the GEMV path routes inside its gate/up
    launch): the same as TorchMoEOps' routing and loop."""
    from tokenmill.kernels.triton.fused_moe import routed_fused_moe

    gate_up, down = _expert_weights(6, 32, 24, dtype, seed=30)
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(3, 32, generator=gen).to(dtype)
    logits = (torch.randn(3, 6, generator=gen) * 2).to(dtype)
    tiles = MoETiles(16, GemmTiles(8, 16), GemmTiles(8, 16), method)
    out = routed_fused_moe(x, logits, gate_up, down, 3, renormalize, dtype != torch.float32, tiles)
    expected = TorchMoEOps().forward(x, logits, gate_up, down, 3, renormalize, dtype != torch.float32)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@interpreted_only
def test_fused_moe_in_bfloat16_is_close_to_the_float32_loop():
    gate_up, down = _expert_weights(8, 64, 32, torch.bfloat16, seed=4)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids = _routes(10, 8, 2, seed=6, skip=(7,)).to(torch.int32)
    weights = torch.rand(10, 2, generator=torch.Generator().manual_seed(7))
    out = fused_moe(x, gate_up, down, weights, ids, MoETiles(16, GemmTiles(32, 32), GemmTiles(32, 32)))
    assert out.dtype == torch.bfloat16
    expected = loop_over_experts(x, gate_up, down, weights, ids.long())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@interpreted_only
def test_fused_moe_through_the_sort_based_align(monkeypatch):
    """Large steps align with torch ops (align_by_sort): the same result."""
    monkeypatch.setattr(moe_align, "SMALL_ALIGN_MAX_CHUNKS", 0)
    gate_up, down = _expert_weights(8, 32, 32, torch.float32, seed=8)
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(9))
    ids = _routes(17, 8, 2, seed=10, skip=(4,))
    weights = torch.rand(17, 2, generator=torch.Generator().manual_seed(11))
    out = fused_moe(x, gate_up, down, weights, ids, MoETiles(16, GemmTiles(32, 32), GemmTiles(32, 32)))
    torch.testing.assert_close(out, loop_over_experts(x, gate_up, down, weights, ids), atol=1e-5, rtol=1e-5)


def _folded_inputs(dtype: torch.dtype, seed: int):
    """A residual row batch h, a post-attention norm weight w, a router and experts; returns
    (h, w, router, gate_up, down, eps)."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(2, 32, generator=gen) * 3).to(dtype)
    norm_weight = (0.5 + torch.rand(32, generator=gen)).to(dtype)
    router = (torch.randn(6, 32, generator=gen) * 0.5).to(dtype)
    gate_up, down = _expert_weights(6, 32, 24, dtype, seed=seed + 1)
    return h, norm_weight, router, gate_up, down, 1e-6


@interpreted_only
@pytest.mark.parametrize(("renormalize", "dtype"), [(True, torch.float32), (False, torch.bfloat16)])
def test_moe_from_the_residual_is_the_residual_plus_the_normed_block(renormalize, dtype):
    """The deferred norm (fused_moe_gemv.py): router and gate/up weights carry the norm weight, the
    GEMV launches read the un-normalized residual h, scale by 1/rms(h) and add h in the down
    epilogue: h + experts(RMSNorm(h) * w), as the separate norm launch would give."""
    from tokenmill.kernels.triton.fused_moe import routed_fused_moe_from_residual

    h, w, router, gate_up, down, eps = _folded_inputs(dtype, seed=40)
    round_weights = dtype != torch.float32
    normed = (F.rms_norm(h.float(), (32,), None, eps).to(dtype) * w).to(dtype)
    expected = h.float() + TorchMoEOps().forward(
        normed, normed @ router.t(), gate_up, down, 3, renormalize, round_weights
    ).float()
    tiles = MoETiles(16, GemmTiles(8, 16), GemmTiles(8, 16), "gemv")
    out = routed_fused_moe_from_residual(
        h, h @ (router * w).t(), gate_up * w, down, 3, renormalize, round_weights, eps, tiles
    )
    assert out.dtype == dtype and out.data_ptr() != h.data_ptr()
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    with pytest.raises(ValueError, match="grouped path"):
        grouped = MoETiles(16, GemmTiles(8, 16), GemmTiles(8, 16), "grouped")
        routed_fused_moe_from_residual(h, h @ router.t(), gate_up, down, 3, renormalize, round_weights, eps, grouped)


@interpreted_only
def test_the_down_launch_refuses_to_add_a_residual_into_itself():
    from tokenmill.kernels.triton.fused_moe_gemv import launch_token_down

    x = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="residual must be another"):
        launch_token_down(
            torch.zeros(3, 24), torch.zeros(6, 32, 24), torch.zeros(3, dtype=torch.int32), torch.ones(3), x, 3,
            GemmTiles(8, 16), residual=x,
        )  # fmt: skip


def _qwen3_moe_block(path, monkeypatch, ops=None) -> tuple[SparseMoEBlock, torch.Tensor]:
    """Layer 0's MoE block of the tiny Qwen3-MoE and its post-attention norm weight, its router's
    linear method allowed to fold (as the CUDA one does)."""
    model = _load(path, cpu_weight_packing=False)  # the router's weight as a plain [E, H] tensor
    layer = model.layers[0]
    block = layer.mlp
    assert isinstance(block, SparseMoEBlock)
    block.moe_ops = ops or TritonMoEOps()
    monkeypatch.setattr(block.gate.method, "folds_input_scale", True)
    return block, layer.post_attention_layernorm.weight.detach().clone()


@interpreted_only
@pytest.mark.parametrize("grouped", [False, True], ids=["gemv", "norm-launch-fallback"])
def test_moe_block_folds_its_norm_and_runs_from_the_residual(tiny_qwen3_moe_dir, monkeypatch, grouped):
    """SparseMoEBlock.fold_input_scale + forward_from_residual (the deferred-norm decode path of
    a layer): h + block(RMSNorm(h) * w) for decode-sized steps, through the GEMV launches or, where
    the tiles take the grouped path, one norm launch first."""
    from tokenmill.kernels.triton import fused_moe

    block, weight = _qwen3_moe_block(tiny_qwen3_moe_dir, monkeypatch)
    eps = 1e-6
    h = torch.randn(1, weight.numel(), generator=torch.Generator().manual_seed(41)) * 2
    with torch.no_grad():
        expected = h + block(F.rms_norm(h, (h.shape[1],), weight, eps))
        assert block.can_fold_input_scale()
        block.fold_input_scale(weight)
        calls = []
        original = fused_moe.routed_fused_moe_from_residual
        monkeypatch.setattr(
            fused_moe, "routed_fused_moe_from_residual", lambda *a, **k: calls.append(1) or original(*a, **k)
        )
        block.moe_ops = TritonMoEOps()  # picks up the counted function
        if grouped:
            monkeypatch.setattr(block.moe_ops, "takes_residual", lambda *a: False)
        out = block.forward_from_residual(h, eps)
    assert bool(calls) != grouped
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@interpreted_only
def test_moe_blocks_that_cannot_fold_their_norm_say_so(tiny_qwen3_moe_dir, tiny_qwen2_moe_dir, monkeypatch):
    """The CPU ops (no deferred-norm launches) and a shared expert (Qwen2-MoE) keep the norm launch."""
    block, weight = _qwen3_moe_block(tiny_qwen3_moe_dir, monkeypatch, ops=TorchMoEOps())
    assert not block.can_fold_input_scale()
    with pytest.raises(ValueError, match="cannot fold"):
        block.fold_input_scale(weight)
    shared, _ = _qwen3_moe_block(tiny_qwen2_moe_dir, monkeypatch)
    assert shared.shared_expert is not None and not shared.can_fold_input_scale()


# -- the CUDA-path MoE block in the tiny models ------------------------------------------------------------


@interpreted_only
@pytest.mark.parametrize("model_dir", ["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir"])
def test_triton_moe_ops_in_the_tiny_models_match_transformers(request, model_dir):
    """Routing kernel + fused experts (the GPU's MoE path) in place of the CPU ops: the same
    logits as transformers, for a prefill chunk and decode steps."""
    path = request.getfixturevalue(model_dir)
    model = _load(path)
    triton_ops = TritonMoEOps()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoEBlock)]
    assert blocks
    for block in blocks:
        block.moe_ops = triton_ops
    prompt = _prompt(model.arch.vocab_size, 20, seed=3)
    harness = PagedHarness(model, seed=3)
    r = harness.add(prompt)
    harness.step([(r, 17)])
    for _ in range(3):
        harness.step([(r, 1)])
    torch.testing.assert_close(harness.logits_of(r), _hf_logits(path, prompt), atol=1e-4, rtol=1e-4)


@interpreted_only
def test_tensor_parallel_shards_of_the_experts_sum_to_the_whole_block():
    """The fused kernels on one rank's experts (half of each intermediate dimension, as tensor
    parallelism holds them): the ranks' partial outputs add up to the whole block's."""
    whole, ranks, x = sharded_moe_blocks(TritonMoEOps())
    with torch.no_grad():
        expected = whole(x)
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(expected, sharded_moe_blocks(TorchMoEOps())[0](x), atol=1e-5, rtol=1e-5)


# -- tile configs ---------------------------------------------------------------------------------------


def test_tuned_tile_files_parse_and_a_batch_takes_the_nearest_entry(tmp_path, monkeypatch):
    for path in sorted(moe_tile_configs.CONFIG_DIR.glob("*.json")):
        record = json.loads(path.read_text())
        assert record["configs"], path
        for entry in record["configs"].values():
            tiles = MoETiles.from_json(entry)
            assert tiles.block_m in (16, 32, 64, 128) and tiles.gate_up.block_k >= 16
    table = {
        "device": "test",
        "configs": {
            "1": MoETiles(16, GemmTiles(32, 64), GemmTiles(64, 64)).to_json(),
            "64": MoETiles(64, GemmTiles(128, 64, 8, 8, 3), GemmTiles(128, 64)).to_json(),
        },
    }
    name = moe_tile_configs.config_file_name(4, 24, 40, torch.bfloat16)
    assert name == "E=4,I=24,H=40,dtype=bfloat16.json"
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setattr(moe_tile_configs, "CONFIG_DIR", tmp_path)
    moe_tile_configs._tuned_table.cache_clear()
    try:
        assert moe_tiles(4, 24, 40, torch.bfloat16, 3, 2).block_m == 16
        assert moe_tiles(4, 24, 40, torch.bfloat16, 40, 2).gate_up.num_warps == 8
        assert moe_tiles(4, 24, 40, torch.bfloat16, 4096, 2).block_m == 64
        # no file for this shape: the default for its pairs per expert
        assert moe_tiles(4, 24, 48, torch.bfloat16, 3, 2) == default_tiles(4, torch.bfloat16, 3, 2)
        (tmp_path / name).write_text(json.dumps({"configs": {"1": {"block_m": 16}}}))
        moe_tile_configs._tuned_table.cache_clear()
        with pytest.raises(ValueError, match="malformed MoE tile config"):
            moe_tiles(4, 24, 40, torch.bfloat16, 3, 2)
    finally:
        moe_tile_configs._tuned_table.cache_clear()


def test_default_tiles_grow_with_the_pairs_per_expert():
    assert default_tiles(128, torch.bfloat16, 1, 8).method == "gemv"  # about one pair per expert
    assert default_tiles(8, torch.bfloat16, 8, 2).method == "grouped"
    assert default_tiles(128, torch.bfloat16, 64, 8).block_m == 16
    assert default_tiles(128, torch.bfloat16, 512, 8).block_m == 32
    assert default_tiles(8, torch.bfloat16, 4096, 2).block_m == 64
    with pytest.raises(ValueError, match="'split'"):
        MoETiles(16, GemmTiles(16, 16), GemmTiles(16, 16), "split")
