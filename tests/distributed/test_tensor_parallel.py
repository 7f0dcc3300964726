"""Tensor parallelism on the CPU (gloo, one worker process per rank): greedy tokens equal
transformers' (and so the one-process engine's) on tiny checkpoints, and the one-process engine's on
the default model; what it cannot split is refused by name before any worker starts.

Checkpoints: 6 query heads so that 2 and 3 ranks divide them; 6 KV heads (split over the ranks)
and 1 KV head (replicated on every rank); intermediate 192 and a vocabulary that 2 or 3 ranks do
not divide evenly (the last rank's padding rows).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.distributed.conftest import SMALL_ENGINE
from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.args import EngineArgs
from tokenmill.errors import EngineDeadError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.quant_config import QuantizationSpec
from tokenmill.model.moe_config import MoEConfig
from tokenmill.model.tensor_parallel import check_tensor_parallel, rank_arch
from tokenmill.sampling_params import StructuredOutputsParams as SO

MAX_NEW = 8
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [300, 17, 42]]


def assert_greedy_equals_hf(llm: LLM, path: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0], f"{len(prompt)}-token prompt"
    llm.engine.check_invariants()


@pytest.mark.parametrize(
    ("checkpoint", "size", "async_scheduling"),
    [("tp_qwen2_dir", 2, True), ("tp_qwen2_dir", 3, False), ("tp_llama_mqa_dir", 3, False)],
)
def test_greedy_equals_transformers(request, checkpoint, size, async_scheduling):
    path = str(request.getfixturevalue(checkpoint))
    llm = LLM(path, tensor_parallel_size=size, async_scheduling=async_scheduling, **SMALL_ENGINE)
    workers = llm.engine.executor._processes
    try:
        assert llm.info.vocab_size % size, "the vocabulary should need padding rows"
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        assert_greedy_equals_hf(llm, path, PROMPTS)
        # A second batch: the workers' request states follow finished requests and prefix hits.
        assert_greedy_equals_hf(llm, path, [PROMPTS[1][:30] + [7, 8], PROMPTS[0]])
        _check_constrained_and_sampled_steps(llm)
        # The last rank killed: the next step (launched ahead of the previous one's result with async
        # scheduling) raises instead of waiting on it, naming the rank.
        workers[-1].kill()
        with pytest.raises(EngineDeadError, match=rf"rank {size - 1} \(pid {workers[-1].pid}\) exited"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_NEW))
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in workers), "workers outlived shutdown"


def _check_constrained_and_sampled_steps(llm: LLM) -> None:
    """Constrained steps go through the two-phase protocol (forward, then the bitmask to every rank);
    sampled steps take rank 0's tokens on every rank, so a seeded request repeats itself exactly."""
    choices = ["alpha", "beta"]
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(choice=choices))
    free = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}], [constrained, free]
    )
    assert out[0].outputs[0].text in choices, out[0].outputs[0].text
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first, again = (
        llm.generate({"prompt_token_ids": PROMPTS[1]}, seeded)[0].outputs[0].token_ids for _ in range(2)
    )
    assert first == again and len(first) == 12


def test_default_model_on_three_ranks_equals_one_rank(default_model_path):
    """SmolLM2-135M: 9 query heads, 3 KV heads: one KV head per rank. Against the one-process engine
    on the same float32 weights (tests/engine/test_default_model.py holds that one to transformers;
    loading transformers' GGUF here again would cost more than the rest of this file)."""
    one = LLM(None, cpu_quantized_gemv=False, **SMALL_ENGINE)
    tok = one.get_tokenizer()
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):"),
        list(range(1000, 1040)),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    three = LLM(None, tensor_parallel_size=3, **SMALL_ENGINE)
    try:
        outputs = three.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        three.engine.check_invariants()
    finally:
        three.shutdown()


def test_default_model_on_two_ranks_is_a_clear_error(default_model_path):
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 does not divide the model's 9 attention heads.*: 1, 3"
    ):
        LLM(None, tensor_parallel_size=2, **SMALL_ENGINE)


@pytest.mark.parametrize(
    ("option", "named"),
    [
        (
            {"speculative_config": {"method": "draft_model", "model": "drafter", "num_speculative_tokens": 2}},
            "speculative_config method 'draft_model'",
        ),
        (
            {"speculative_config": {"method": "eagle3", "model": "drafter", "num_speculative_tokens": 2}},
            "speculative_config method 'eagle3'",
        ),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8"),
        ({"kv_offload_gb": 1.0}, "kv_offload_gb"),
        ({"kv_role": "consumer", "kv_transfer_address": "tcp://127.0.0.1:5590"}, "kv_role"),
    ],
)
def test_unsupported_options_are_refused_by_name(option, named):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 does not support {named}"):
        EngineArgs(tensor_parallel_size=2, **option).create_engine_config(resolve_device=False)
    EngineArgs(tensor_parallel_size=1, **option).create_engine_config(resolve_device=False)  # fine alone


def _arch(**overrides) -> ArchConfig:
    base = ArchConfig(
        architecture="llama", vocab_size=1000, hidden_size=96, intermediate_size=192, num_layers=2,
        num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


def test_what_cannot_be_split_is_refused_before_loading():
    # Every family we load shards; one that does not is refused by name (a family added to the
    # registry without sharding: model/llama.py's supports_tensor_parallel stops it at build, too).
    with pytest.raises(ValueError, match=r"'falcon' family is not sharded.*supported: llama, .*gpt_oss"):
        check_tensor_parallel(_arch(architecture="falcon"), 2)
    with pytest.raises(ValueError, match=r"quantized weights \(awq\) are not sharded"):
        check_tensor_parallel(_arch(), 2, quantization="awq")
    # Quantized weights split where each rank's shard keeps the scheme's blocks whole.
    fp8 = QuantizationSpec("fp8", "fp8_w8a8", from_checkpoint=False)
    gptq = QuantizationSpec("gptq", "int4_w4a16", from_checkpoint=True, int4_format="gptq", group_size=16)
    for fits in (fp8, dataclasses.replace(fp8, from_checkpoint=True), gptq):
        check_tensor_parallel(_arch(), 2, quantization=fits)  # o_proj: 48 input columns per rank
    for refused, reason in (
        (dataclasses.replace(gptq, act_order=True), r"\(act-order\)"),
        (dataclasses.replace(gptq, group_size=32), r"o_proj 48 input columns \(blocks of 32\)"),
        (dataclasses.replace(gptq, group_size=-1, from_checkpoint=False), "per-channel 4-bit scales"),
        (
            dataclasses.replace(fp8, from_checkpoint=True, fp8_weight_strategy="block", fp8_block=(128, 128)),
            r"q_proj 48 output rows \(blocks of 128\)",
        ),
    ):
        with pytest.raises(ValueError, match=rf"quantized weights \({re.escape(refused.describe())}\).*{reason}"):
            check_tensor_parallel(_arch(), 2, quantization=refused)
    moe = _arch(architecture="qwen3_moe", moe=MoEConfig(4, 2, 96, renormalize=True, sparse_layers=(0, 1)))
    check_tensor_parallel(moe, 2)  # the 16-bit experts shard
    check_tensor_parallel(moe, 2, quantization=fp8)  # per-row scales quantized at load: any split
    with pytest.raises(ValueError, match="4-bit mixture-of-experts experts are not sharded"):
        check_tensor_parallel(moe, 2, quantization=gptq)
    block = dataclasses.replace(fp8, from_checkpoint=True, fp8_weight_strategy="block", fp8_block=(128, 128))
    with pytest.raises(ValueError, match=r"experts' gate_proj / up_proj 48 output rows \(blocks of 128\)"):
        check_tensor_parallel(dataclasses.replace(moe, num_heads=8, num_kv_heads=8, head_dim=16,
                                                  intermediate_size=256), 2, quantization=block)  # fmt: skip
    with pytest.raises(ValueError, match="KV heads: one must divide the other"):
        check_tensor_parallel(_arch(num_kv_heads=2), 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        EngineArgs(tensor_parallel_size=0).create_engine_config(resolve_device=False)
    check_tensor_parallel(_arch(architecture="falcon"), 1)  # one rank splits nothing


def test_each_rank_holds_its_share_of_the_heads():
    assert (rank_arch(_arch(), 2).num_heads, rank_arch(_arch(), 2).num_kv_heads) == (3, 1)
    assert (rank_arch(_arch(), 6).num_heads, rank_arch(_arch(), 6).num_kv_heads) == (1, 1)  # KV replicated
    assert rank_arch(_arch(), 1) == _arch()
