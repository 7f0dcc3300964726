"""The CPU's 16-bit few-row matmul (kernels/cpu/csrc/cpu_gemv16.cpp) and where it serves: the linear
method for --dtype bfloat16 / float16 (model/layers/cpu_gemv16_linear.py) and the mixture-of-experts
experts (layers/moe.py CpuGemv16MoEOps). Against float32 sums of the same 16-bit values, and the
engine's greedy tokens and logprobs with the kernel against KernelConfig.cpu_gemv16 off."""

from __future__ import annotations

import pytest
import torch

from tests.moe_checkpoints import tiny_qwen3_moe_dir  # noqa: F401  (fixture)
from tokenmill.kernels.cpu import gemv16 as gemv16_kernel
from tokenmill.kernels.cpu.build import load_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    load_cpu_kernels()
    if gemv16_kernel.rows_limit() == 0:
        pytest.skip(
            "this CPU build of the kernels has no vector path for gemv16 (AVX-512 or AVX2 + FMA + F16C)"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 37, 100), (2, 130, 77), (3, 64, 33), (4, 300, 2048), (1, 5, 8)]
)
def test_products_are_float32_sums_of_the_16bit_values(dtype, m, n, k) -> None:
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    exact = x.double() @ w.double().T
    as_float = gemv16_kernel.gemv16(x, w, out_dtype=torch.float32)
    # float32 sums of k products of 16-bit values (each exact in float32), in some order
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T)
    assert ((as_float.double() - exact).abs() <= bound).all()
    rounded = gemv16_kernel.gemv16(x, w)
    assert rounded.dtype == dtype
    # One rounding of the float32 sum: equal to rounding the exact sum but where it lies within a
    # summation error of a rounding boundary (1 ulp at most).
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((rounded.double() - exact).abs() <= ulp + bound).all()
    assert (rounded == as_float.to(dtype)).all()


def test_what_it_serves() -> None:
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert gemv16_kernel.serves(torch.zeros(4, 16, dtype=torch.bfloat16), w)
    assert not gemv16_kernel.serves(torch.zeros(5, 16, dtype=torch.bfloat16), w)  # a prefill chunk
    assert not gemv16_kernel.serves(torch.zeros(1, 16, dtype=torch.float16), w)  # dtypes differ
    assert not gemv16_kernel.serves(torch.zeros(1, 16), torch.zeros(8, 16))  # float32: oneDNN's
    assert not gemv16_kernel.serves(torch.zeros(1, 16, dtype=torch.bfloat16), w.t().contiguous().t())
    with pytest.raises(RuntimeError, match="1 <= M <= 4"):
        torch.ops.tokenmill_cpu.gemv16(
            torch.empty(5, 8, dtype=torch.bfloat16), torch.zeros(5, 16, dtype=torch.bfloat16), w
        )
    with pytest.raises(RuntimeError, match="w must be a contiguous"):
        torch.ops.tokenmill_cpu.gemv16(
            torch.empty(1, 8, dtype=torch.bfloat16), torch.zeros(1, 16, dtype=torch.bfloat16), w.half()
        )


def _generate(model_dir, dtype: str, gemv16: bool, prompts: list[list[int]]):
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        str(model_dir), device="cpu", dtype=dtype, max_model_len=128, kernel_config={"cpu_gemv16": gemv16}
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.close()
    return [
        (o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        for o in outputs
    ]


def _counting_kernel_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = gemv16_kernel.gemv16

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(gemv16_kernel, "gemv16", counted)
    return calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_moe_dir"])
def test_greedy_tokens_and_logprobs_as_with_f_linear(model, dtype, request, monkeypatch) -> None:
    """Qwen2 has q/k/v biases (added in float32 before the rounding); the Qwen3-MoE's experts go
    through CpuGemv16MoEOps. One request decodes alone (one-row products) and three together."""
    model_dir = request.getfixturevalue(model)
    prompts = [[5, 17, 300, 42, 7], [9, 8, 7], [100, 101, 102, 103]]
    reference = _generate(model_dir, dtype, False, prompts[:1]) + _generate(model_dir, dtype, False, prompts)
    calls = _counting_kernel_calls(monkeypatch)
    ours = _generate(model_dir, dtype, True, prompts[:1]) + _generate(model_dir, dtype, True, prompts)
    assert calls[0] > 0, "the 16-bit GEMV never ran"
    for (ref_tokens, ref_logprobs), (tokens, logprobs) in zip(reference, ours, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(ref_logprobs, logprobs, strict=True)) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "inter", "top_k", "weights_in_model_dtype"),
    [(1, 8, 64, 96, 2, False), (3, 8, 64, 96, 2, True), (4, 16, 100, 48, 4, False), (2, 4, 64, 32, 3, True)],
)
def test_fused_experts_round_as_the_torch_ops(
    dtype, tokens, experts, hidden, inter, top_k, weights_in_model_dtype
):
    """moe_experts16 (up to four tokens, every used expert read once) against TorchMoEOps.experts on
    the same 16-bit weights: the same roundings, products summed in float32 in another order; tokens
    sharing an expert and odd sizes (100, 48: the kernels' tails) included."""
    from tokenmill.model.layers.moe import CpuGemv16MoEOps, TorchMoEOps

    torch.manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter) * 0.2).to(dtype)
    weights, ids = TorchMoEOps().route(
        torch.randn(tokens, experts).to(dtype), top_k, True, weights_in_model_dtype
    )
    reference = TorchMoEOps().experts(x, gate_up, down, weights, ids)
    assert gemv16_kernel.serves_experts(x, gate_up, down)
    ours = CpuGemv16MoEOps().experts(x, gate_up, down, weights, ids)
    assert ours.dtype == dtype
    tolerance = 2 * torch.finfo(dtype).eps * reference.abs().max().item()
    torch.testing.assert_close(ours.float(), reference.float(), atol=tolerance, rtol=0)
    assert (ours == reference).float().mean() > 0.95  # most bit-equal: only sums near a rounding tie differ


def test_fused_experts_refuse_bad_ids() -> None:
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    gate_up, down = torch.zeros(4, 8, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"expert id 4 is outside \[0, 4\)"):
        gemv16_kernel.moe_experts16(x, gate_up, down, torch.ones(1, 1), torch.tensor([[4]]))
    assert not gemv16_kernel.serves_experts(torch.zeros(5, 16, dtype=torch.bfloat16), gate_up, down)
    assert not gemv16_kernel.serves_experts(x.float(), gate_up.float(), down.float())
