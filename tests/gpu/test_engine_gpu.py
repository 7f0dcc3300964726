"""The whole engine on a CUDA GPU: greedy output equals transformers', with and without CUDA graphs.

fp32: token for token against transformers on the CPU, for one request and 16 concurrent ones.
bf16: the first 32 greedy tokens equal transformers' bf16 on the GPU and the chosen tokens'
logprobs stay close; graphs and eager give identical greedy output. Also: padded graph rows
write no KV slot, a decode step syncs with the host once (bringing the sampled ids back), the
KV pool is sized by profiling, and the fused kernels round like transformers.

The tiny checkpoints (tiny_llama_dir, ...) come from the shared tests/conftest.py.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import random

import pytest
import torch

from tests.engine.hf_oracle import check_hf_applies_soft_cap, hf_greedy, hf_load_kwargs
from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

TINY_MODELS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]


@pytest.fixture(params=TINY_MODELS)
def tiny_model(request) -> str:
    return str(request.getfixturevalue(request.param))


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("device", "cuda")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_num_seqs", 32)
    return LLM(path, **kwargs)


def _prompts(vocab_size: int, count: int, seed: int, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


def _greedy(llm: LLM, prompts: list[list[int]], max_new: int, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=logprobs)
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _graph_replays(llm: LLM) -> int:
    graphs = llm.engine.runner.graph_runner
    return 0 if graphs is None else graphs.num_replays


@functools.cache
def _hf_bf16_cuda(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **hf_load_kwargs(path))
    check_hf_applies_soft_cap(model)
    return model.to("cuda").eval()


def _hf_greedy_bf16_with_ties(
    path: str, prompt: list[int], max_new: int
) -> tuple[list[int], list[float], list[float], list[bool]]:
    """transformers' bf16 greedy tokens on the GPU, their logprobs, each step's margin between the
    two best logprobs, and whether its two best logits lie within two bf16 ulps (at the best
    logit's magnitude) of each other: a tie at the precision the logits carry."""
    model = _hf_bf16_cuda(path)
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    top2 = [lp.topk(2).values.tolist() for lp in logprobs]
    chosen = [lp[t].item() for lp, t in zip(logprobs, tokens, strict=True)]
    ties = []
    for step in out.logits:
        best, second = step[0].float().topk(2).values.tolist()
        ulp = 2.0 ** (math.floor(math.log2(max(abs(best), 1e-30))) - 7)  # bf16: 8 significant bits
        ties.append(best - second <= 2 * ulp)
    return tokens, chosen, [a - b for a, b in top2], ties


def _bf16_logprob_diffs_allowing_ties(path: str, prompt: list[int], completion, max_new: int) -> list[float]:
    """Compares a bf16 greedy completion (with logprobs) against transformers' bf16 on the GPU:
    the tokens are identical, except that at a step whose two best transformers logits lie
    within two bf16 ulps (a tie at the precision the logits carry: any other summation order may
    break it the other way) ours may take the other one, after which the sequences are compared
    no further; at least the first 4 tokens must agree. Returns |logprob differences| over the
    compared tokens."""
    tokens, expected_lps, margins, ties = _hf_greedy_bf16_with_ties(path, prompt, max_new)
    compared = max_new
    if completion.token_ids != tokens:
        i = next(i for i, (a, b) in enumerate(zip(completion.token_ids, tokens, strict=True)) if a != b)
        if not ties[i]:
            pytest.fail(
                f"diverged at token {i}: ours {completion.token_ids[i]}, transformers {tokens[i]}; "
                f"transformers' top-2 logprob margin there {margins[i]:.4f}; logprob of its token: "
                f"ours {completion.logprobs[i].get(tokens[i])}, transformers {expected_lps[i]:.4f}"
            )
        compared = i
    assert compared >= 4, "diverged within the first 4 tokens"
    assert completion.logprobs is not None
    return [
        abs(pos[t].logprob - lp)
        for pos, t, lp in zip(completion.logprobs[:compared], tokens, expected_lps, strict=False)
    ]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp32_greedy_matches_transformers(tiny_model, enforce_eager):
    llm = _llm(tiny_model, dtype="float32", enforce_eager=enforce_eager)
    assert llm.info.dtype == "float32"
    single = _prompts(llm.info.vocab_size, 1, seed=11)
    concurrent = _prompts(llm.info.vocab_size, 16, seed=12)
    for prompts in (single, concurrent):
        for prompt, completion in zip(prompts, _greedy(llm, prompts, 16), strict=True):
            assert completion.token_ids == hf_greedy(tiny_model, prompt, 16)[0], f"{len(prompt)}-token prompt"
    if enforce_eager:
        assert llm.engine.runner.graph_runner is None
    else:
        assert _graph_replays(llm) > 0, "decode steps did not go through the CUDA graphs"
    llm.engine.check_invariants()


def test_bf16_greedy_and_logprobs_match_transformers(tiny_model, monkeypatch):
    """Four requests at once (their decode steps' matmuls run the skinny GEMM, 2-8 rows): the
    first 32 greedy tokens equal transformers' bf16 ones, up to a tie (see
    _bf16_logprob_diffs_allowing_ties; the tiny Qwen2 met an exact one, margin 0, at token 14 of
    one prompt on an H200 with the skinny GEMM), and the logprobs stay close."""
    from tokenmill.kernels.triton import skinny_gemm

    skinny_calls = []
    original = skinny_gemm.skinny_gemm

    def counted(*args, **kwargs):
        skinny_calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_gemm", counted)
    llm = _llm(tiny_model)  # dtype auto = bfloat16 on CUDA
    assert llm.info.dtype == "bfloat16"
    prompts = _prompts(llm.info.vocab_size, 4, seed=13, min_len=8)
    diffs = []
    for prompt, completion in zip(prompts, _greedy(llm, prompts, 32, logprobs=0), strict=True):
        diffs += _bf16_logprob_diffs_allowing_ties(tiny_model, prompt, completion, 32)
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    assert 4 in skinny_calls, f"row counts of skinny GEMM calls: {sorted(set(skinny_calls))}"


def test_bf16_greedy_identical_with_and_without_graphs_and_async_scheduling(tiny_llama_dir):
    path = str(tiny_llama_dir)
    results = []
    for enforce_eager, async_scheduling in ((False, True), (True, True), (False, False), (True, False)):
        llm = _llm(path, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == async_scheduling
        prompts = _prompts(llm.info.vocab_size, 16, seed=14)
        results.append([c.token_ids for c in _greedy(llm, prompts, 32)])
        assert (_graph_replays(llm) > 0) != enforce_eager
        del llm
        gc.collect()
    assert results[0] == results[1] == results[2] == results[3]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_decode_rope_in_attention_launch_changes_nothing(model, request):
    """Decode steps rotate q/k and store K/V inside the attention launch; with that switched off
    (the separate RoPE + KV-store launch) greedy tokens and logprobs are the same, bit for bit."""
    path = str(request.getfixturevalue(model))
    results = []
    for fused in (True, False):
        # The deferred norm (its own test below) rounds differently from separate norm launches.
        llm = _llm(path, kernel_config={"fused_decode_rope": fused, "deferred_norm": False})
        # One request at a time: single-request decode steps are the ones the fused launch serves.
        prompts = _prompts(llm.info.vocab_size, 3, seed=15)
        completions = [_greedy(llm, [prompt], 24, logprobs=0)[0] for prompt in prompts]
        results.append(
            [(c.token_ids, [next(iter(lp.values())).logprob for lp in c.logprobs]) for c in completions]
        )
        assert _graph_replays(llm) > 0
        del llm
        gc.collect()
    assert results[0] == results[1]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_request_decode_steps_match_transformers(model, dtype, request, monkeypatch):
    """Single-request decode steps take their own path: 32-token attention tiles, RoPE + KV
    store inside the attention launch (for Qwen3 with its Q/K norms), and for models whose norm
    weights are folded into qkv / gate_up (Llama, Mistral: no q/k/v bias, no Q/K norm; the tiny
    checkpoints' norm weights are random, not ones) no norm launches: the attention launch and
    silu_mul apply 1/rms, o_proj and down add into the residual; in bf16 every matmul of these
    steps is the row GEMV (kernels/triton/gemv.py), fp32 keeps cuBLAS. fp32 greedy tokens equal
    transformers' (CPU) token for token; bf16 the first 32 equal transformers' bf16 on the GPU,
    with close logprobs, except that a step where transformers' two best logits are within two
    bf16 ulps may pick the other one, after which the sequences are compared no further. (These
    paths round in a different order from transformers': the deferred norm projects the
    un-normalized row and scales after, and attention sums 32-token tiles. On an H200 the tiny
    Mistral met such ties at 1 ulp (token 7) and at 2 ulps (token 18) of a 32-token run.)"""
    from tokenmill.model import llama

    path = str(request.getfixturevalue(model))
    calls = []
    deferred = llama.DecoderLayer._forward_deferred_norm

    def counted(self, *args, **kwargs):
        calls.append(1)
        return deferred(self, *args, **kwargs)

    monkeypatch.setattr(llama.DecoderLayer, "_forward_deferred_norm", counted)
    from tokenmill.kernels.triton import gemv

    gemv_calls = []
    row_gemv = gemv.row_gemv

    def counted_gemv(*args, **kwargs):
        gemv_calls.append(1)
        return row_gemv(*args, **kwargs)

    monkeypatch.setattr(gemv, "row_gemv", counted_gemv)
    from tokenmill.model.layers.attention import SelfAttention

    fused_calls = []
    fused = SelfAttention.attend_with_rope_in_launch

    def counted_fused(self, *args, **kwargs):
        fused_calls.append(1)
        return fused(self, *args, **kwargs)

    monkeypatch.setattr(SelfAttention, "attend_with_rope_in_launch", counted_fused)
    llm = _llm(path, dtype=dtype)
    folds = model in ("tiny_llama_dir", "tiny_mistral_dir")
    assert all(layer.norms_folded == folds for layer in llm.engine.runner.model.layers)
    prompts = _prompts(llm.info.vocab_size, 3, seed=18, min_len=8)
    diffs = []
    for prompt in prompts:  # one at a time: single-request steps are the deferred ones
        if dtype == "float32":
            completion = _greedy(llm, [prompt], 24)[0]
            assert completion.token_ids == hf_greedy(path, prompt, 24)[0], f"{len(prompt)}-token prompt"
            continue
        completion = _greedy(llm, [prompt], 32, logprobs=0)[0]
        diffs += _bf16_logprob_diffs_allowing_ties(path, prompt, completion, 32)
    if diffs:
        assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    assert bool(calls) == folds, f"{len(calls)} calls of the deferred-norm path"
    assert fused_calls, "no decode step fused RoPE into the attention launch"
    assert bool(gemv_calls) == (dtype == "bfloat16"), f"{len(gemv_calls)} row GEMV calls"
    assert _graph_replays(llm) > 0


def test_async_scheduling_is_the_cuda_default(tiny_llama_dir):
    assert _llm(str(tiny_llama_dir)).engine.async_scheduling


def test_padded_graph_rows_write_no_kv_slot(tiny_llama_dir):
    llm = _llm(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    runner = llm.engine.runner
    # Random (finite) pool contents, so a stray write of anything shows up as a change.
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    prompts = _prompts(llm.info.vocab_size, 3, seed=15, min_len=10, max_len=20)  # 3 rows -> graph of 4
    max_new = 8
    _greedy(llm, prompts, max_new)
    assert 3 not in runner.graph_runner.sizes and _graph_replays(llm) > 0
    changed = torch.zeros(runner.kv_caches[0].shape[1:3], dtype=torch.bool, device="cuda")
    for cache, old in zip(runner.kv_caches, before, strict=True):
        changed |= (cache != old).flatten(3).any(dim=-1).any(dim=0)
    # Every computed token wrote exactly its own slot: prompt + outputs except the last one.
    expected = sum(len(p) + max_new - 1 for p in prompts)
    assert int(changed.sum()) == expected


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_steps_sync_with_the_host_only_for_the_sampled_ids(tiny_llama_dir, enforce_eager, async_scheduling):
    """In "error" mode any synchronizing call raises; the runner exempts only its one wait for the
    sampled ids. A raise inside a step would end the batch's requests with an error."""
    llm = _llm(str(tiny_llama_dir), enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    prompts = _prompts(llm.info.vocab_size, 7, seed=16)

    def add(first: int, last: int) -> None:
        for i in range(first, last):
            llm.engine.add_request(llm.input_processor.make_request(f"sync-{i}", prompts[i], params))

    add(0, 5)
    llm.engine.step()  # the first step compiles and allocates; not part of the steady state
    replays_before = _graph_replays(llm)
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(6):
            if step == 2:
                add(5, 7)  # a mixed prefill + decode step, then decodes of 7 (a padded graph of 8)
            outputs.extend(llm.engine.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(out.error is None and len(out.new_token_ids) == 1 for out in outputs)
    # Steps 1-6 ran, the third with the two new requests. Async scheduling returns each step's
    # tokens one step later: steps 0-5's.
    assert len(outputs) == (5 * 3 + 7 * 3 if async_scheduling else 5 * 2 + 7 * 4)
    assert (_graph_replays(llm) - replays_before == 5) != enforce_eager


def test_kv_pool_is_sized_by_profiling(tiny_llama_dir):
    total = torch.cuda.mem_get_info()[1]
    llm = _llm(str(tiny_llama_dir), num_kv_blocks=None, gpu_memory_utilization=0.3, enforce_eager=True)
    runner = llm.engine.runner
    pool_bytes = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    # A tiny model: nearly the whole 30 % goes to the pool, and never more than that.
    assert 0.2 * total < pool_bytes < 0.3 * total
    assert torch.cuda.memory_reserved() < 0.3 * total
    out = _greedy(llm, _prompts(llm.info.vocab_size, 2, seed=17), 4)
    assert all(len(c.token_ids) == 4 for c in out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_round_like_transformers(dtype):
    from tokenmill.kernels.triton.elementwise import add_rms_norm, rope_inplace, silu_mul
    from tokenmill.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", dtype=dtype, generator=gen)
    delta = torch.randn(37, 4096, device="cuda", dtype=dtype, generator=gen)
    weight = torch.rand(4096, device="cuda", dtype=dtype, generator=gen) + 0.5
    summed = x + delta
    variance = summed.float().pow(2).mean(-1, keepdim=True)
    expected = weight * (summed.float() * torch.rsqrt(variance + 1e-5)).to(dtype)
    out = add_rms_norm(x, weight, 1e-5, delta)
    assert torch.equal(x, summed)  # the residual stream now holds the rounded sum
    ulp = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - expected.float()).abs().max() <= ulp * expected.float().abs().max()

    rotary = RotaryEmbedding(128, 4096, 500000.0, None, device="cuda", dtype=dtype)
    qkv = torch.randn(37, 48 * 128, device="cuda", dtype=dtype, generator=gen)
    qk = qkv[:, : 40 * 128].view(37, 40, 128)  # strided rows, as the model's fused qkv has them
    positions = torch.randint(0, 4096, (37,), device="cuda", generator=gen)
    cos = rotary.cos_cache[positions].unsqueeze(1)
    sin_half = rotary.sin_cache[positions][:, 64:]  # the table holds [-sin, sin]
    sin = torch.cat([sin_half, sin_half], dim=-1).unsqueeze(1)
    rotate_half = torch.cat([-qk[..., 64:], qk[..., :64]], dim=-1)
    expected_rope = qk * cos + rotate_half * sin
    untouched = qkv[:, 40 * 128 :].clone()
    rope_inplace(qk, positions, rotary.cos_cache, rotary.sin_cache)
    # bf16: every intermediate rounded where transformers rounds it, so bit for bit; fp32 may
    # differ by an ulp where the compiler fuses a multiply-add.
    exact = {"rtol": 0.0, "atol": 0.0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(qk, expected_rope, **exact)
    assert torch.equal(qkv[:, 40 * 128 :], untouched)

    gate_up = torch.randn(37, 2 * 14336, device="cuda", dtype=dtype, generator=gen)
    expected_act = torch.nn.functional.silu(gate_up[:, :14336]) * gate_up[:, 14336:]
    # exp itself may differ by an ulp between Triton and PyTorch.
    one_ulp = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(silu_mul(gate_up), expected_act, **one_ulp)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_greedy_sample_kernel_at_real_vocab_size(rows):
    from tokenmill.kernels.triton.greedy import greedy_sample

    gen = torch.Generator(device="cuda").manual_seed(rows)
    # bf16 logits upcast, as the lm_head gives them: many exact ties, which go to the first index.
    logits = torch.randn(rows, 128256, device="cuda", generator=gen).to(torch.bfloat16).float()
    logits[0, 100] = logits[0, 90000] = 1e4
    if rows > 1:
        logits[-1, 5] = float("nan")
    out = greedy_sample(logits)
    expected = logits.argmax(dim=-1)
    assert out[0, : rows - 1 if rows > 1 else 1].tolist() == expected[: rows - 1 if rows > 1 else 1].tolist()
    assert out[0, 0].item() == 100
    assert out[1].tolist() == [0] * (rows - 1) + [1] if rows > 1 else out[1].tolist() == [0]


def test_row_gemv_at_llama_8b_shapes():
    """The row GEMV at the decode matmuls' real shapes (its long K slices and 8-warp programs only
    run here), in a CUDA graph as decode steps run it: within one bf16 ulp of a float32 matmul
    rounded once, residual added in place, lm_head's float32 logits close to float32; the engine
    hands it exactly the one-row bf16 matmuls."""
    from tokenmill.kernels.triton.gemv import row_gemv, use_row_gemv

    rows = 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    one_ulp = {"rtol": 2**-7, "atol": 1e-4}
    for n, k, adds in [(6144, 4096, False), (4096, 4096, True), (28672, 4096, False), (4096, 14336, True)]:
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        residual = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
        expected = x.float() @ weight.float().t() + (residual.float() if adds else 0)
        out = residual.clone()
        row_gemv(x, weight, residual=out if adds else None, out=out)  # warm-up: compile outside the capture
        out.copy_(residual)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            row_gemv(x, weight, residual=out if adds else None, out=out)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected.to(torch.bfloat16), **one_ulp)
    lm_head = (torch.randn(128256, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    hidden = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    logits = row_gemv(hidden, lm_head, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ lm_head.float().t(), rtol=1e-4, atol=1e-3)
    assert use_row_gemv(hidden, lm_head)
    assert not use_row_gemv(torch.cat([hidden, hidden]), lm_head)  # two rows: the skinny GEMM
    assert not use_row_gemv(hidden.float(), lm_head.float())  # float32: cuBLAS
    assert not use_row_gemv(hidden, lm_head.t().contiguous().t())  # in-major: cuBLAS


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_skinny_gemm_at_llama_8b_shapes(rows):
    """The skinny GEMM (2-8 rows) at the decode matmuls' real shapes with their configs, in a
    CUDA graph: within one bf16 ulp of a float32 matmul rounded once; lm_head's float32 logits
    close to float32; each row's result independent of how many rows share the launch (so a
    graph's padding rows change nothing)."""
    from tokenmill.kernels.triton.skinny_gemm import skinny_gemm, use_skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(rows)
    one_ulp = {"rtol": 2**-7, "atol": 1e-4}
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        assert use_skinny_gemm(x, weight)
        skinny_gemm(x, weight)  # warm-up: compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = skinny_gemm(x, weight)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (x.float() @ weight.float().t()).to(torch.bfloat16), **one_ulp)
        assert torch.equal(skinny_gemm(x[:1].repeat(2, 1), weight)[0], out[0])
    lm_head = (torch.randn(128256, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    hidden = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    logits = skinny_gemm(hidden, lm_head, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ lm_head.float().t(), rtol=1e-4, atol=1e-3)
    assert not use_skinny_gemm(hidden[:1].repeat(9, 1), lm_head)  # 9 rows: cuBLAS


def test_close_frees_the_gpu_and_a_second_llm_gets_the_same_kv_pool(tiny_llama_dir):
    """LLM.close() on CUDA frees the KV pool, the weights and the CUDA graphs: an LLM made after it
    profiles the same free memory, so it sizes the same KV pool (less the first's per-process
    leftovers) and gives the same greedy output, and
    closing it leaves torch's allocated memory exactly where the first close did (nothing per LLM
    stays; vLLM users' "del llm frees nothing"). What the first LLM leaves is per process: the
    cuBLAS workspace of the piecewise graphs' capture stream (64 MiB on an H200)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [40, 41, 42]}]
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pools, outputs, after = [], [], []
    for _ in range(2):
        llm = LLM(str(tiny_llama_dir), device="cuda", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3)
        pools.append(llm.engine.runner.num_blocks)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert torch.cuda.memory_allocated() - before > 2**30  # the pool: 30 % of the GPU, less weights
        llm.close()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert after[0] - before <= 128 * 2**20, f"the first closed LLM kept {(after[0] - before) / 2**20:.0f} MiB"
    assert after[1] - after[0] < 2**20, f"the second LLM kept {(after[1] - after[0]) / 2**20:.1f} MiB more"
    # The second profile sees the first LLM's per-process leftovers (that workspace) as used.
    assert pools[0] * 0.99 <= pools[1] <= pools[0]
    assert outputs[0] == outputs[1]
