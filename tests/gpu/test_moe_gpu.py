"""Mixture-of-experts models and the fused MoE kernel on a CUDA GPU.

- The tiny MoE checkpoints through the whole engine (CUDA graphs for decode): bf16 greedy tokens
  equal transformers' bf16 on the GPU up to bf16 ties, with close logprobs; fp32 token for token
  against transformers on the CPU; decode and mixed steps sync with the host only for the
  sampled ids.
- fused_moe at real shapes (Mixtral-8x7B: E=8, H=4096, I=14336, top-2; Qwen3-30B-A3B: E=128,
  H=2048, I=768, top-8) against a float32 loop over experts, eagerly, through the sort-based
  align of large steps, and replayed from a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests import moe_checkpoints
from tests.engine.hf_oracle import hf_greedy
from tests.gpu.test_engine_gpu import _graph_replays, _greedy, _hf_greedy_bf16_with_ties, _llm, _prompts
from tests.moe_checkpoints import MOE_FIXTURES
from tokenmill import SamplingParams

if torch.cuda.is_available():
    import triton  # noqa: F401  (compiled mode for this process, as in test_triton_attention_gpu.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir


@pytest.fixture(params=MOE_FIXTURES)
def moe_model(request) -> str:
    return str(request.getfixturevalue(request.param))


def test_bf16_greedy_and_logprobs_mostly_match_transformers(moe_model, monkeypatch):
    """Four requests at once, 32 greedy tokens each through the CUDA graphs, against transformers'
    bf16 greedy tokens on the GPU. Unlike a dense model, a MoE model may take another expert
    wherever two router logits lie within bf16 rounding of each other (in any layer, at any
    step), and that moves the token's logits well past a bf16 tie (seen on an H100: the tiny
    Mixtral diverged at token 20 of one prompt with transformers' top-2 margin 0.34 there). So
    the tokens are compared up to each prompt's first divergence: most of them must agree and
    their logprobs stay close. A divergence where transformers' two best logits tie at bf16
    precision (as test_engine_gpu.py allows; the tiny Qwen3-MoE has exact ties at the first token
    of two of these prompts, margin 0.0 in bf16 on the CPU too) counts as agreement to the end.
    (fp32, below, must agree token for token.) The fused kernels ran."""
    from tokenmill.kernels.triton import fused_moe

    calls = []
    original = fused_moe.routed_fused_moe
    monkeypatch.setattr(
        fused_moe, "routed_fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or original(*a, **k)
    )
    llm = _llm(moe_model)
    assert llm.info.dtype == "bfloat16"
    prompts = _prompts(llm.info.vocab_size, 4, seed=13, min_len=8)
    _assert_mostly_agrees_with_transformers_bf16(moe_model, prompts, _greedy(llm, prompts, 32, logprobs=0))
    assert _graph_replays(llm) > 0 and calls


def _assert_mostly_agrees_with_transformers_bf16(model: str, prompts, completions) -> None:
    """32 greedy tokens a prompt against transformers' bf16 on the GPU, compared up to each prompt's
    first divergence (to the end where transformers' two best logits tie there): at least half of
    all tokens agree, and their logprobs are close."""
    agreed, diffs = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        tokens, expected_lps, _, ties = _hf_greedy_bf16_with_ties(model, prompt, 32)
        same = next((i for i, (a, b) in enumerate(zip(completion.token_ids, tokens, strict=True)) if a != b), 32)
        agreed.append(32 if same < 32 and ties[same] else same)
        diffs += [abs(completion.logprobs[i][tokens[i]].logprob - expected_lps[i]) for i in range(same)]
    assert sum(agreed) >= 0.5 * len(prompts) * 32, f"tokens agreeing before the first divergence, per prompt: {agreed}"
    diffs.sort()
    assert diffs and diffs[len(diffs) // 2] < 0.02 and diffs[int(0.9 * len(diffs))] < 0.1, (agreed, diffs[-5:])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp32_greedy_matches_transformers(moe_model, enforce_eager):
    llm = _llm(moe_model, dtype="float32", enforce_eager=enforce_eager)
    prompts = _prompts(llm.info.vocab_size, 6, seed=12)
    for prompt, completion in zip(prompts, _greedy(llm, prompts, 16), strict=True):
        assert completion.token_ids == hf_greedy(moe_model, prompt, 16)[0], f"{len(prompt)}-token prompt"
    assert (_graph_replays(llm) > 0) != enforce_eager
    llm.engine.check_invariants()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_request_decode_steps_skip_the_norm_launches(moe_model, dtype, monkeypatch):
    """Single-request decode steps of MoE models without a shared expert or Q/K norms (Mixtral)
    take the deferred-norm path (llama.DecoderLayer._forward_deferred_norm): the norm weights are
    folded into qkv, the router and the experts' gate/up, the attention launch and the experts'
    GEMV launches apply 1/rms, o_proj and down add into the residual. fp32 greedy tokens equal
    transformers' (CPU); bf16 as the batched test above allows (experts may flip where router
    logits tie at bf16 precision). Qwen2-MoE (a shared expert) and Qwen3-MoE (Q/K norms: see
    DecoderLayer.fold_norm_weights) keep their norm launches."""
    from tokenmill.kernels.triton import fused_moe

    calls = []
    original = fused_moe.routed_fused_moe_from_residual
    monkeypatch.setattr(
        fused_moe, "routed_fused_moe_from_residual", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    llm = _llm(moe_model, dtype=dtype)
    folds = "mixtral" in moe_model
    assert all(layer.norms_folded == folds for layer in llm.engine.runner.model.layers)
    prompts = _prompts(llm.info.vocab_size, 3, seed=19, min_len=8)
    if dtype == "float32":
        for prompt in prompts:  # one at a time: single-request steps are the deferred ones
            completion = _greedy(llm, [prompt], 16)[0]
            assert completion.token_ids == hf_greedy(moe_model, prompt, 16)[0], f"{len(prompt)}-token prompt"
    else:
        completions = [_greedy(llm, [prompt], 32, logprobs=0)[0] for prompt in prompts]
        _assert_mostly_agrees_with_transformers_bf16(moe_model, prompts, completions)
    assert bool(calls) == folds, f"{len(calls)} calls of the experts' deferred-norm launches"
    assert _graph_replays(llm) > 0


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_moe_steps_sync_with_the_host_only_for_the_sampled_ids(tiny_qwen3_moe_dir, enforce_eager):
    """As tests/gpu/test_engine_gpu.py checks for dense models: routing, align and the grouped
    GEMMs read nothing back to the host ("error" mode raises on any synchronizing call)."""
    llm = _llm(str(tiny_qwen3_moe_dir), enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, detokenize=False)
    prompts = _prompts(llm.info.vocab_size, 7, seed=16)
    for i in range(5):
        llm.engine.add_request(llm.input_processor.make_request(f"sync-{i}", prompts[i], params))
    llm.engine.step()  # compiles and allocates
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(6):
            if step == 2:
                for i in range(5, 7):
                    llm.engine.add_request(llm.input_processor.make_request(f"sync-{i}", prompts[i], params))
            outputs.extend(llm.engine.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert outputs and all(out.error is None for out in outputs)


# -- the kernel at real shapes --------------------------------------------------------------------------

REAL_SHAPES = {  # name: (experts, hidden, intermediate, top_k)
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}


def _real_experts(name: str, seed: int = 0):
    num_experts, hidden, inter, top_k = REAL_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16)
    return gate_up.mul_(hidden**-0.5), down.mul_(inter**-0.5), top_k


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _loop_over_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.linear(x[token].float(), gate_up[expert].float())
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[expert].float())
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 2100])  # 2100 x top-k pairs: align_by_sort for both
def test_fused_moe_at_real_shapes_matches_a_loop_over_experts(shape, num_tokens):
    from tokenmill.kernels.triton.fused_moe import fused_moe

    gate_up, down, top_k = _real_experts(shape)
    x = torch.randn(num_tokens, gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, gate_up.shape[0], top_k, seed=num_tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused_moe(x, gate_up, down, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _relative_error(out, _loop_over_experts(x, gate_up, down, weights, ids.long())) < 1e-2


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_fused_moe_replays_from_a_cuda_graph_with_new_routes(shape):
    """Captured once; new inputs and routes copied into the same buffers replay correctly."""
    from tokenmill.bench.timing import capture_graph
    from tokenmill.kernels.triton.fused_moe import fused_moe

    gate_up, down, top_k = _real_experts(shape, seed=1)
    num_tokens = 8
    x = torch.randn(num_tokens, gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, gate_up.shape[0], top_k, seed=1)
    outputs = []
    graph = capture_graph(lambda: outputs.append(fused_moe(x, gate_up, down, weights, ids)), warmup=2)
    for seed in (2, 3):
        new_weights, new_ids = _routing(num_tokens, gate_up.shape[0], top_k, seed=seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.normal_()
        graph.replay()
        expected = _loop_over_experts(x, gate_up, down, weights, ids.long())
        assert _relative_error(outputs[-1], expected) < 1e-2


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
@pytest.mark.parametrize("method", ["gemv", "grouped"])
def test_both_few_token_paths_at_real_shapes(shape, method):
    """Whatever the tuned tiles pick for a few tokens, both paths stay right."""
    from tokenmill.kernels.triton.fused_moe import fused_moe
    from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles

    gate_up, down, top_k = _real_experts(shape, seed=4)
    if method == "gemv":
        tiles = MoETiles(16, GemmTiles(4, 512, 1, 4, 2), GemmTiles(8, 256, 1, 4, 2), "gemv")
    else:
        tiles = MoETiles(16, GemmTiles(64, 128, 1, 4, 4), GemmTiles(64, 128, 1, 4, 4))
    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
        weights, ids = _routing(num_tokens, gate_up.shape[0], top_k, seed=num_tokens + 4)
        out = fused_moe(x, gate_up, down, weights, ids, tiles)
        assert _relative_error(out, _loop_over_experts(x, gate_up, down, weights, ids.long())) < 1e-2


@pytest.mark.parametrize("shape", list(REAL_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4, 300])
def test_routed_fused_moe_at_real_shapes(shape, num_tokens):
    """Routing + experts as the engine calls them (the few-token path routes inside its gate/up
    launch): the same experts and output as torch's softmax / top-k and the loop."""
    from tokenmill.kernels.triton.fused_moe import routed_fused_moe

    gate_up, down, top_k = _real_experts(shape, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, gate_up.shape[0], device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(num_tokens, gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = routed_fused_moe(x, logits, gate_up, down, top_k, renormalize=True, round_to_logits_dtype=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    weights, ids = torch.softmax(logits.float(), -1).topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16).float()
    assert _relative_error(out, _loop_over_experts(x, gate_up, down, weights, ids)) < 1e-2
