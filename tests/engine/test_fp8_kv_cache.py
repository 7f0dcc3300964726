"""`--kv-cache-dtype fp8` through the whole engine on the CPU: tiny Llama / Qwen3 checkpoints with an
e4m3 KV cache against the same engine with a float32 cache, per-KV-head scales against the same
scales folded into the weights by hand, the pool's capacity, prefix caching and a sliding-window
model over an FP8 cache, and the names that are refused.

On the CPU the C++ attention kernels read 16- and 32-bit caches only: with the default backend
(auto) the runner takes the torch reference backend for an FP8 cache and logs it; naming
`--attention-backend cpu` with fp8 is an error that names the options that work.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.sliding_window_checkpoints import WindowBound, random_prompts, write_sliding_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.attention import SelfAttention

POOL_BYTES = 8 * 2**20
MAX_NEW = 8
# Per family, prompts at whose first MAX_NEW greedy steps the float32 model's best token leads the
# runner-up by at least MIN_MARGIN in logprob (the tiny random models have near-ties elsewhere,
# which a perturbation of K and V this size may flip; the test checks the margins first). The
# long ones span several 16-token blocks.
PROMPTS = {
    "llama": [
        [11, 2, 30, 18],
        [732, 849, 808, 689, 645, 6, 631, 510, 852, 893, 346, 254, 752, 338, 725, 896, 69, 200, 586, 232, 249,
         827, 150, 827, 561, 463, 98, 87, 332],
        [525, 506, 116, 313, 569, 303, 728, 132, 565, 345, 839, 558, 213, 823, 622, 565, 606, 299, 460, 98,
         615, 822, 399, 329, 594, 252, 302, 193, 198, 846, 196, 38, 632, 677, 271, 492, 75, 96, 700, 780, 138,
         158, 44, 867, 87, 721, 854, 558, 704, 405, 862, 727, 542, 287, 539, 836, 246, 874, 225, 700],
    ],
    "qwen3": [
        [841, 592, 654, 552, 621, 701],
        [451, 189, 67, 520, 483, 45, 615, 108, 721, 405, 209, 271, 372, 754, 486, 863, 588, 178, 719, 693, 213,
         790, 64, 812, 697, 167],
        [170, 355, 547, 261, 125, 616, 457, 686, 184, 18, 487, 702, 424, 587, 525, 323, 669, 370, 402, 862, 678,
         261, 162, 579, 712, 17, 473, 764, 85, 348, 761, 51, 562, 292, 143, 250, 785, 498, 365, 629, 299, 694,
         372, 609, 653, 879, 640, 140, 737, 322, 402, 771, 429, 853, 671, 87, 6, 613],
    ],
}  # fmt: skip
MIN_MARGIN = 0.25
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
# e4m3 keeps 3 mantissa bits, so every cached K and V value carries up to 2^-4 relative rounding
# error, 16 times bf16's 2^-8. Measured on these runs (the prompts here, 8 tokens; the sliding-window
# test's 40): the chosen tokens' logprobs moved by at most 0.11 (Llama), 0.125 (Qwen3) and 0.17
# (the Qwen2 sliding-window model) against a float32 cache, where a bf16 cache moves them by
# 0.012-0.015: 8-12 times less, as the mantissas predict. The bound leaves about 2x room, while a
# cache read without its scales, or rows stored in the wrong slots, moves them by whole units.
LOGPROB_TOLERANCE = 0.3


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", POOL_BYTES)
    return LLM(str(path), device="cpu", max_model_len=128, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Per prompt: the greedy tokens and their logprobs."""
    return [(tokens, logprobs) for tokens, logprobs, _ in _greedy_with_margins(llm, prompts)]


def _greedy_with_margins(
    llm: LLM, prompts: list[list[int]]
) -> list[tuple[list[int], list[float], list[float]]]:
    """Per prompt: the greedy tokens, their logprobs, and by how much each led the runner-up."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
        margins = []
        for step, token in zip(completion.logprobs, tokens, strict=True):
            others = [entry.logprob for other, entry in step.items() if other != token]
            margins.append(step[token].logprob - max(others) if others else float("inf"))
        results.append((tokens, logprobs, margins))
    llm.engine.check_invariants()
    return results


def _max_logprob_gap(a, b) -> float:
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True))


def _attention_layers(llm: LLM) -> list[SelfAttention]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SelfAttention)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_cache_tracks_a_float32_cache(family: str, request) -> None:
    path = request.getfixturevalue(f"tiny_{family}_dir")
    prompts = PROMPTS[family]
    fp32 = _greedy_with_margins(_llm(path), prompts)
    assert min(min(margins) for _, _, margins in fp32) >= MIN_MARGIN, "the prompts no longer have clear winners"
    llm = _llm(path, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert runner.attn_backend.name == "torch"  # auto on the CPU: the reference reads FP8
    assert all(cache.dtype == torch.float8_e4m3fn for cache in runner.kv_caches)
    fp8 = _greedy(llm, prompts)
    assert [tokens for tokens, _ in fp8] == [tokens for tokens, _, _ in fp32]
    gap = _max_logprob_gap(fp8, [(tokens, logprobs) for tokens, logprobs, _ in fp32])
    assert 0 < gap < LOGPROB_TOLERANCE, gap  # > 0: the cache really rounds
    assert llm.engine.scheduler.kv.usage == 0.0  # every block back in the pool
    # The alias names the same cache.
    assert _greedy(_llm(path, kv_cache_dtype="fp8_e4m3"), prompts) == fp8


def _fold_scales_into_weights(
    src: Path, dst: Path, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]
) -> Path:
    """A copy of a Llama checkpoint whose attention computes K / k_scale and V / v_scale per KV head
    and compensates in q_proj (scores unchanged) and o_proj (output unchanged): with scale 1 its
    FP8 cache holds the very bytes the original holds with those scales."""
    import shutil

    from transformers import AutoConfig

    shutil.copytree(src, dst)
    config = AutoConfig.from_pretrained(src)
    head_dim = config.head_dim
    group = config.num_attention_heads // config.num_key_value_heads
    [weights_file] = dst.glob("*.safetensors")
    weights = load_file(weights_file)
    for layer, (k_scale, v_scale) in enumerate(zip(k_scales, v_scales, strict=True)):
        prefix = f"model.layers.{layer}.self_attn."
        per_kv_row = lambda s: s.repeat_interleave(head_dim)[:, None]  # noqa: E731
        per_q_row = lambda s: s.repeat_interleave(group * head_dim)[:, None]  # noqa: E731
        weights[prefix + "k_proj.weight"] = weights[prefix + "k_proj.weight"] / per_kv_row(k_scale)
        weights[prefix + "v_proj.weight"] = weights[prefix + "v_proj.weight"] / per_kv_row(v_scale)
        weights[prefix + "q_proj.weight"] = weights[prefix + "q_proj.weight"] * per_q_row(k_scale)
        weights[prefix + "o_proj.weight"] = weights[prefix + "o_proj.weight"] * per_q_row(v_scale).T
    save_file(weights, weights_file, metadata={"format": "pt"})
    return dst


def test_scales_on_the_layers_equal_the_scales_folded_into_the_weights(tiny_llama_dir, tmp_path) -> None:
    """Per-KV-head scales set on the layers (as a checkpoint's k_scale / v_scale would be) against
    an unscaled FP8 cache of a checkpoint with the same scales folded into its weights. Powers of
    two make the folding exact in float32; ones this large and small push K and V into e4m3's
    subnormals and saturation, so the scales visibly change what is stored."""
    k_scales = [torch.tensor([8.0, 0.5]), torch.tensor([0.25, 16.0])]
    v_scales = [torch.tensor([0.125, 4.0]), torch.tensor([32.0, 1.0])]
    scaled = _llm(tiny_llama_dir, kv_cache_dtype="fp8")
    layers = _attention_layers(scaled)
    assert len(layers) == 2
    for layer, k_scale, v_scale in zip(layers, k_scales, v_scales, strict=True):
        layer.set_kv_scales(k_scale, v_scale)
        assert layer.layer_spec.k_scale is layer.k_scale  # the backend reads the buffers themselves
    folded_dir = _fold_scales_into_weights(tiny_llama_dir, tmp_path / "folded", k_scales, v_scales)
    prompts = PROMPTS["llama"]
    with_scales = _greedy(scaled, prompts)
    folded = _greedy(_llm(folded_dir, kv_cache_dtype="fp8"), prompts)
    assert [tokens for tokens, _ in with_scales] == [tokens for tokens, _ in folded]
    assert _max_logprob_gap(with_scales, folded) < 1e-4
    unscaled = _greedy(_llm(tiny_llama_dir, kv_cache_dtype="fp8"), prompts)
    assert _max_logprob_gap(with_scales, unscaled) > 1e-3  # the scales did change the cache
    # A 16-bit or float32 cache ignores the scales.
    fp32_with_scales = _llm(tiny_llama_dir)
    for layer, k_scale, v_scale in zip(_attention_layers(fp32_with_scales), k_scales, v_scales, strict=True):
        layer.set_kv_scales(k_scale, v_scale)
    assert _greedy(fp32_with_scales, prompts) == _greedy(_llm(tiny_llama_dir), prompts)


def test_set_kv_scales_takes_per_tensor_or_per_head_values_and_refuses_others(tiny_llama_dir) -> None:
    layer = _attention_layers(_llm(tiny_llama_dir, kv_cache_dtype="fp8"))[0]
    layer.set_kv_scales(torch.tensor(0.5), 2.0)  # per tensor: a 0-d checkpoint tensor, a number
    assert layer.k_scale.tolist() == [0.5, 0.5] and layer.v_scale.tolist() == [2.0, 2.0]
    layer.set_kv_scales(torch.tensor([1.5, 3.0]), torch.tensor([[0.25]]))
    assert layer.k_scale.tolist() == [1.5, 3.0] and layer.v_scale.tolist() == [0.25, 0.25]
    assert dict(layer.named_buffers()).keys() >= {"k_scale", "v_scale"}  # where checkpoints name them
    with pytest.raises(ValueError, match=r"k_scale has 3 values; expected 1 \(per tensor\) or 2"):
        layer.set_kv_scales(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match=r"v_scale must be positive and finite"):
        layer.set_kv_scales(1.0, torch.tensor([1.0, 0.0]))
    assert layer.k_scale.tolist() == [1.5, 3.0]  # a refused call changes neither scale


def test_the_pool_holds_four_times_a_float32_cache_and_twice_a_bf16_one(tiny_llama_dir) -> None:
    infos = {
        dtype: _llm(tiny_llama_dir, kv_cache_dtype=dtype).engine.info for dtype in ("auto", "bfloat16", "fp8")
    }
    assert infos["fp8"].num_kv_blocks == 4 * infos["auto"].num_kv_blocks == 2 * infos["bfloat16"].num_kv_blocks
    assert infos["fp8"].kv_capacity_tokens == 4 * infos["auto"].kv_capacity_tokens
    assert infos["fp8"].kv_capacity_tokens == infos["fp8"].num_kv_blocks * infos["fp8"].block_size


def test_prefix_caching_over_an_fp8_cache(tiny_llama_dir) -> None:
    """A second request sharing three blocks of prompt reads them from the FP8 cache the first
    wrote, and continues as without prefix caching (the same tokens; logprobs up to the float32
    rounding of differently batched attention)."""
    shared = list(range(100, 148))
    prompts = [shared + [7, 8, 9], shared + [21, 22]]
    cached = _llm(tiny_llama_dir, kv_cache_dtype="fp8")
    got = _greedy(cached, prompts[:1])
    [second] = cached.generate([{"prompt_token_ids": prompts[1]}], GREEDY)
    assert second.num_cached_tokens == 48
    got += _greedy(cached, prompts[1:])
    expected = _greedy(_llm(tiny_llama_dir, kv_cache_dtype="fp8", enable_prefix_caching=False), prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert _max_logprob_gap(got, expected) < 1e-4


def test_a_sliding_window_model_over_an_fp8_cache(tmp_path, tiny_tokenizer) -> None:
    """Qwen2 with a 32-token window on two of its four layers (a full and a sliding KV cache group
    sharing the pool), decoding 40 tokens past prompts several windows long over an FP8 cache:
    every sliding group's blocks stay bounded by the window, and each token's logprob is within
    the FP8 tolerance of what the float32-cache engine gives that very sequence (teacher-forced
    through its prompt logprobs: this model's greedy steps have near-ties, so comparing free-running
    tokens would test those instead)."""
    path = write_sliding_checkpoint(tmp_path / "qwen2_hybrid", "qwen2_hybrid", tiny_tokenizer)
    fp8 = LLM(str(path), device="cpu", max_model_len=256, kv_cache_dtype="fp8")
    prompts = random_prompts(fp8.info.vocab_size, 3, seed=3, min_len=70, max_len=110)
    bound = WindowBound(fp8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    outputs = fp8.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert bound.sliding_groups()  # the bound was checked on a sliding group
    fp8.engine.check_invariants()
    fp32 = LLM(str(path), device="cpu", max_model_len=256)
    sequences = [p + list(out.outputs[0].token_ids) for p, out in zip(prompts, outputs, strict=True)]
    forced = fp32.generate(
        [{"prompt_token_ids": s} for s in sequences], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    for prompt, out, reference in zip(prompts, outputs, forced, strict=True):
        tokens = out.outputs[0].token_ids
        got = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        forced_steps = reference.prompt_logprobs[len(prompt) :]
        expected = [step[t].logprob for step, t in zip(forced_steps, tokens, strict=True)]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < LOGPROB_TOLERANCE


def test_the_auto_backend_falls_back_to_the_reference_and_says_so(tiny_llama_dir, caplog) -> None:
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    if not cpu_kernels_available()[0]:
        pytest.skip("the C++ CPU kernels are unavailable: auto picks the reference anyway")
    with caplog.at_level(logging.INFO, logger="tokenmill.worker.model_runner"):
        llm = _llm(tiny_llama_dir, kv_cache_dtype="fp8")
    assert llm.engine.runner.attn_backend.name == "torch"
    assert "attention backend: torch, since the cpu backend cannot keep a float8_e4m3fn KV cache" in caplog.text
    with pytest.raises(ValueError, match=r"the cpu attention backend cannot keep a float8_e4m3fn KV cache.*"
                       r"use kv_cache_dtype=auto or --attention-backend torch"):  # fmt: skip
        _llm(tiny_llama_dir, kv_cache_dtype="fp8", attention_backend="cpu")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp8_e5m2", r"kv_cache_dtype 'fp8_e5m2' is not supported .*use fp8 \(e4m3\) or one of auto, float32"),
        ("int8", r"kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8, fp8_e4m3.*got 'int8'"),
    ],
)
def test_names_that_are_refused(tiny_llama_dir, name: str, message: str) -> None:
    from tokenmill.args import EngineArgs
    from tokenmill.cli import build_parser

    with pytest.raises(ValueError, match=message):
        _llm(tiny_llama_dir, kv_cache_dtype=name)
    if name == "fp8_e5m2":  # the CLI takes the name and the same check refuses it
        args = build_parser().parse_args(["generate", "hi", "--device", "cpu", "--kv-cache-dtype", name])
        with pytest.raises(ValueError, match=message):
            EngineArgs.from_cli_args(args).create_engine_config()
