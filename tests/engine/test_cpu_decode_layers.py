"""The CPU's decode steps with the decoder layers in one C++ call (model/cpu_decode_plan.py,
kernels/cpu/csrc/cpu_decode_layers.cpp): the Python layer loop's outputs bit for bit where it
serves (the default model's decode steps), the loop itself where it does not."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.cpu_decode_plan import CpuDecodePlan
from tokenmill.model.layers.linear_method import WrappingLinearMethod

pytestmark = pytest.mark.usefixtures("default_model_path")


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """How many steps each went through the op (counted per call of the plan)."""
    calls: list[int] = []
    original = CpuDecodePlan.__call__

    def counted(self, x, rope, kv_caches, meta):
        calls.append(x.shape[0])
        return original(self, x, rope, kv_caches, meta)

    monkeypatch.setattr(CpuDecodePlan, "__call__", counted)
    return calls


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return [
        (out.outputs[0].token_ids, [sorted(pos.items()) for pos in out.outputs[0].logprobs]) for out in results
    ]


def _prompts(seed: int, count: int, low: int, high: int, vocab: int = 40000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _params(count: int) -> list[SamplingParams]:
    """Greedy with logprobs, and seeded sampling (the same draws on both paths if the logits are)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=1)
        for i in range(count)
    ]


def test_decode_steps_equal_the_layer_loop_bit_for_bit(fused_calls):
    """One request alone (one-row steps: the few-row product) and seven at once (seven-row steps:
    the batched 16-bit product on AVX2 builds), tokens and logprobs identical to the loop's."""
    options = {"device": "cpu", "max_model_len": 256, "seed": 0}
    loop = LLM(None, kernel_config={"fused_decode_layers": False}, **options)
    fused = LLM(None, **options)
    alone, together = _prompts(0, 1, 20, 20), _prompts(1, 7, 5, 60)
    expected = [_outputs(loop, alone, _params(1)), _outputs(loop, together, _params(7))]
    assert not fused_calls, "the loop's engine went through the op"
    got = [_outputs(fused, alone, _params(1)), _outputs(fused, together, _params(7))]
    assert 1 in fused_calls and max(fused_calls) == 7, fused_calls
    assert got == expected


def test_chunked_prefill_preemption_and_prefix_hits_equal_the_loop(fused_calls):
    """Steps mixing 16-token prefill chunks (the op serves chunks up to the attention kernel's 16
    rows) with decodes, preemption in a 12-block pool and prefix-cache hits: the same outputs."""
    options = {
        "device": "cpu", "max_model_len": 128, "seed": 0, "max_num_batched_tokens": 16, "num_kv_blocks": 12,
        "block_size": 8,
    }  # fmt: skip
    prompts = _prompts(2, 6, 20, 40)
    prompts += [prompts[0][:17] + p[:5] for p in prompts[1:3]]  # share a cached prefix with the first
    params = _params(len(prompts))
    expected = _outputs(LLM(None, kernel_config={"fused_decode_layers": False}, **options), prompts, params)
    assert not fused_calls
    fused = LLM(None, **options)
    assert _outputs(fused, prompts, params) == expected
    assert max(fused_calls) == 16, "no step with a 16-token chunk went through the op"
    assert fused.engine.scheduler.num_preemptions_total > 0, "the small pool preempted nothing"


def test_models_it_does_not_replicate_keep_the_loop(fused_calls, tiny_llama_dir):
    """float32 activations (no integer-activation blocks), a non-GGUF checkpoint, a linear method
    swapped after the plan was gathered: the plan says why not, and the loop runs."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    float_acts = LLM(None, device="cpu", max_model_len=64, kernel_config={"cpu_activation_bits": 0})
    float_acts.generate({"prompt_token_ids": [1, 2, 3]}, params)
    assert "integer-activation" in float_acts.engine.runner.model.ops._decode_plan.why_not
    tiny = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    tiny.generate({"prompt_token_ids": [1, 2, 3]}, params)
    assert "products" in tiny.engine.runner.model.ops._decode_plan.why_not
    assert not fused_calls

    fused = LLM(None, device="cpu", max_model_len=64)
    fused.generate({"prompt_token_ids": [1, 2, 3]}, params)
    model = fused.engine.runner.model
    plan = model.ops._decode_plan
    assert plan.why_not is None and plan.current(model) and fused_calls
    linear = model.layers[3].mlp.down_proj
    blocks_method = linear.method

    class Wrapped(WrappingLinearMethod):
        pass

    linear.method = Wrapped(blocks_method)
    try:
        assert not plan.current(model)
        assert "Wrapped products" in CpuDecodePlan(model).why_not
        before = len(fused_calls)
        fused.generate({"prompt_token_ids": [1, 2, 3]}, params)
        assert len(fused_calls) == before and model.ops._decode_plan is not plan
    finally:
        linear.method = blocks_method


def test_qwen2_gguf_with_qkv_bias_equals_the_loop(fused_calls, tmp_path, tiny_tokenizer):
    """Qwen2's q/k/v bias (added after the product, as the loop adds it) in a Q4_1 GGUF written the
    way llama.cpp writes Qwen2 files (Q/K rows not permuted)."""
    from gguf.constants import GGMLQuantizationType

    from tests.conftest import write_tiny_checkpoint
    from tests.model.test_loader import _write_gguf_like_llama_cpp

    src = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2", tiny_tokenizer, seed=5, tie_word_embeddings=True)
    gguf_path = tmp_path / "tiny-qwen2-Q4_1.gguf"
    _write_gguf_like_llama_cpp(src, gguf_path, GGMLQuantizationType.Q4_1, arch="qwen2")
    options = {"tokenizer": str(src), "device": "cpu", "max_model_len": 128, "seed": 0}
    prompts = _prompts(3, 3, 4, 30, vocab=1000)
    loop = LLM(str(gguf_path), kernel_config={"fused_decode_layers": False}, **options)
    assert loop.engine.runner.model.layers[0].self_attn.qkv_proj._applied_bias is not None
    expected = _outputs(loop, prompts, _params(3))
    fused = LLM(str(gguf_path), **options)
    assert _outputs(fused, prompts, _params(3)) == expected
    plan = fused.engine.runner.model.ops._decode_plan
    assert plan.why_not is None and len(plan.qkv_biases) == len(fused.engine.runner.model.layers)
    assert fused_calls


def test_the_op_checks_its_lists():
    from tokenmill.kernels.cpu.build import load_cpu_kernels

    load_cpu_kernels()
    x = torch.zeros(1, 8)
    empty = torch.zeros(0)
    with pytest.raises(RuntimeError, match="expected 2 norms a layer"):
        torch.ops.tokenmill_cpu.decode_layers(
            x, None, [], [empty] * 4, [0] * 4, [16] * 4, [], [empty], empty, empty, empty, empty, empty, empty,
            1, 1, 8, 1.0, 1e-5, 16, [0], 1,
        )  # fmt: skip
