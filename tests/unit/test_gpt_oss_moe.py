"""gpt-oss's MoE block (layers/gpt_oss_moe.py) and the fused MoE kernels' gpt-oss flags (expert
biases, clamped SwiGLU; kernels/triton/fused_moe.py) against transformers' GptOssMLP /
GptOssExperts (a loop over experts) on the same weights, at tiny shapes: the CPU path, and the
kernels under TRITON_INTERPRET=1 (as test_fused_moe_triton.py: set before triton is imported; a
process that imported triton compiled reruns this file in an interpreter subprocess).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import gpt_oss_checkpoint  # noqa: E402
from tests.model.test_model_forward import PagedHarness, _hf_logits, _load, _prompt  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.model.arch_gpt_oss import gpt_oss_arch_config  # noqa: E402
from tokenmill.model.gpt_oss import _in_our_expert_layout  # noqa: E402
from tokenmill.model.layers.gpt_oss_moe import GptOssMoEBlock, route_top_k_then_softmax  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, timeout=600)  # run by the subprocess test below

tiny_gpt_oss_dir = gpt_oss_checkpoint.tiny_gpt_oss_dir

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)
ALPHA, LIMIT = 1.702, 7.0


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process interprets the kernels: the cases below ran here")
    INTERPRETED_RUN.assert_passes()


def _hf_mlp(num_experts: int = 8, top_k: int = 2, hidden: int = 64, inter: int = 32, seed: int = 0):
    """transformers' GptOssMLP (router + experts) with random weights, biases included, wide
    enough that the clamp cuts some gate/up values."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts, num_experts_per_tok=top_k,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    mlp = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            scale = 1.0 if name == "experts.gate_up_proj" else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return config, mlp


def _our_block(config, mlp, dtype: torch.dtype = torch.float32) -> GptOssMoEBlock:
    arch = gpt_oss_arch_config({**config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert arch.moe is not None
    block = GptOssMoEBlock(config.hidden_size, arch.moe, dtype=dtype)
    prefix = "model.layers.0.mlp."
    named = [(prefix + n, p.detach()) for n, p in mlp.named_parameters()]
    with torch.no_grad():
        for name, tensor in _in_our_expert_layout(named):
            part = name.removeprefix(prefix)
            if part.startswith("router."):
                getattr(block.router, part.removeprefix("router.")).copy_(tensor)
            else:
                block.experts.weight_loader(part.removeprefix("experts."), tensor)
    return block


def _hf_out(mlp, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return mlp(x[None])[0][0]


def test_arch_parses_the_tiny_config() -> None:
    config, _ = _hf_mlp()
    arch = gpt_oss_arch_config({
        **config.to_dict(), "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16,
    })  # fmt: skip
    assert arch.architecture == "gpt_oss" and arch.sliding_windows == (16, None, 16, None)
    assert arch.attention_bias and arch.o_proj_bias
    assert arch.moe is not None and arch.moe.biases and arch.moe.clamped_swiglu == (ALPHA, LIMIT)
    assert arch.moe.sparse_layers == (0, 1, 2, 3) and arch.moe.top_k == 2
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    assert arch.rope_scaling["truncate"] is False


def test_routing_order_is_transformers() -> None:
    config, mlp = _hf_mlp()
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_scores, hf_ids = mlp.router(x)
        logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
        weights, ids = route_top_k_then_softmax(logits, 2)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_scores, rtol=0, atol=1e-7)


def test_cpu_block_matches_transformers_with_the_clamp_active() -> None:
    config, mlp = _hf_mlp()
    block = _our_block(config, mlp)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(2))
    # The clamp must matter for this to test it: some gate/up pre-activations exceed the limit.
    with torch.no_grad():
        gate_up = torch.einsum("th,ehn->etn", x, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias[:, None]
    assert (gate_up[..., ::2] > LIMIT).any() and (gate_up[..., 1::2].abs() > LIMIT).any()
    with torch.no_grad():
        ours = block(x)
    torch.testing.assert_close(ours, _hf_out(mlp, x), rtol=1e-5, atol=5e-5)  # fp32, other summation orders


@interpreted_only
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 19])  # 1-2: the shapes the tiles send to the GEMVs
def test_fused_kernels_with_biases_and_clamp_match_transformers(num_tokens: int) -> None:
    config, mlp = _hf_mlp()
    block = _our_block(config, mlp)
    block.use_fused_kernels()
    x = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(3 + num_tokens))
    with torch.no_grad():
        ours = block(x)
    torch.testing.assert_close(ours, _hf_out(mlp, x), rtol=1e-5, atol=5e-5)  # fp32, other summation orders


@interpreted_only
def test_fused_kernels_with_an_expert_that_gets_no_tokens() -> None:
    from tokenmill.kernels.triton.fused_moe import fused_moe

    config, mlp = _hf_mlp()
    block = _our_block(config, mlp)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(7, generator=gen)[:2] for _ in range(6)])  # expert 7 never chosen
    weights = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
    experts = block.experts
    with torch.no_grad():
        ours = fused_moe(
            x, experts.gate_up_proj, experts.down_proj, weights, ids.to(torch.int32),
            gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
            clamped_swiglu=(ALPHA, LIMIT),
        )  # fmt: skip
        expected = mlp.experts(x, ids, weights)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=5e-5)  # fp32, other summation orders


@interpreted_only
def test_fused_kernels_in_bf16_are_close_to_transformers() -> None:
    config, mlp = _hf_mlp()
    mlp = mlp.to(torch.bfloat16)
    block = _our_block(config, mlp, dtype=torch.bfloat16)
    block.use_fused_kernels()
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        ours, expected = block(x).float(), _hf_out(mlp, x).float()
    scale = expected.abs().max()
    assert (ours - expected).abs().max() <= 0.02 * scale


@interpreted_only
def test_flags_off_is_the_plain_swiglu() -> None:
    """Without biases or the clamp the kernels compute plain SwiGLU experts (what Mixtral / Qwen
    MoE get), so the flags leave them as they were."""
    from tokenmill.kernels.triton.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(7)
    e, h, i, t = 4, 32, 16, 5
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) * 0.2, torch.randn(e, h, i, generator=gen) * 0.2
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
    expected = torch.zeros_like(x)
    for tok in range(t):
        for k in range(2):
            gate_up = w13[ids[tok, k]] @ x[tok]
            act = torch.nn.functional.silu(gate_up[:i]) * gate_up[i:]
            expected[tok] += weights[tok, k] * (w2[ids[tok, k]] @ act)
    ours = fused_moe(x, w13, w2, weights, ids.to(torch.int32))
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=5e-5)  # fp32, other summation orders


def test_bias_shape_is_checked() -> None:
    pytest.importorskip("triton")
    from tokenmill.kernels.triton.fused_moe import fused_moe

    w13, w2 = torch.zeros(4, 8, 6), torch.zeros(4, 6, 4)
    with pytest.raises(ValueError, match="gate_up_bias must be a \\[4, 8\\]"):
        fused_moe(torch.zeros(2, 6), w13, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32),
                  gate_up_bias=torch.zeros(4, 4))  # fmt: skip


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=interpreted_only)])
def test_tiny_model_logits_match_transformers(tiny_gpt_oss_dir, fused: bool) -> None:
    """The whole tiny model (sinks, alternating windows of 16, YaRN, the MoE blocks) over a
    paged KV cache: a 37-token chunk, then 3 decode steps, past two windows; the MoE blocks on the
    CPU path or on the fused kernels (CUDA's path, interpreted)."""
    model = _load(tiny_gpt_oss_dir)
    blocks = [m for m in model.modules() if isinstance(m, GptOssMoEBlock)]
    assert len(blocks) == 4
    if fused:
        for block in blocks:
            block.use_fused_kernels()
    prompt = _prompt(model.arch.vocab_size, 40, seed=3)
    harness = PagedHarness(model, seed=3)
    r = harness.add(prompt)
    harness.step([(r, 37)])
    for _ in range(3):
        harness.step([(r, 1)])
    torch.testing.assert_close(harness.logits_of(r), _hf_logits(tiny_gpt_oss_dir, prompt), atol=1e-4, rtol=1e-4)


def test_an_mxfp4_gpt_oss_checkpoint_is_refused_at_resolve(tmp_path, tiny_gpt_oss_dir) -> None:
    """The published checkpoints' MXFP4 experts are another format: refused before any weight."""
    from tests.model.test_quant_config import _quantized_copy
    from tokenmill.config import ModelConfig
    from tokenmill.errors import UnsupportedModelError
    from tokenmill.model.resolve import resolve_model

    model_dir = _quantized_copy(tiny_gpt_oss_dir, tmp_path / "mxfp4", {"quant_method": "mxfp4"})
    with pytest.raises(UnsupportedModelError, match="quant_method = 'mxfp4'"):
        resolve_model(ModelConfig(model=str(model_dir)))
