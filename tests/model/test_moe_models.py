"""Mixture-of-experts families (model/moe_models.py): config parsing, both checkpoint layouts, and
logits equal to transformers' through the paged KV cache on the CPU path (layers/moe.py
TorchMoEOps). The Triton path is checked against the same oracle in tests/unit/test_fused_moe_triton.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import moe_checkpoints
from tests.model.test_model_forward import PagedHarness, _hf_logits, _load, _prompt
from tests.moe_checkpoints import MOE_FIXTURES
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.moe import SparseMoEBlock, TorchMoEOps, unread_expert_bytes
from tokenmill.model.llama import CausalLM
from tokenmill.model.loader.safetensors_loader import iter_safetensors_weights
from tokenmill.model.moe_models import MoECausalLM

# The tiny MoE checkpoints (session fixtures shared with the other MoE test modules).
tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_mixtral_stacked_dir = moe_checkpoints.tiny_mixtral_stacked_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir

ROOT = Path(__file__).parents[2]


@pytest.fixture(params=[*MOE_FIXTURES, "tiny_mixtral_stacked_dir"])
def moe_dir(request) -> Path:
    return request.getfixturevalue(request.param)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# -- configs ------------------------------------------------------------------------------------------


def test_arch_config_reads_each_family(tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir):
    mixtral = ArchConfig.from_hf_config(_config(tiny_mixtral_dir))
    assert mixtral.architecture == "mixtral" and not mixtral.attention_bias and not mixtral.qk_norm
    assert mixtral.moe is not None
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.expert_intermediate_size) == (8, 2, 96)
    assert mixtral.moe.renormalize and not mixtral.moe.weights_in_model_dtype
    assert mixtral.moe.sparse_layers == (0, 1) and mixtral.moe.shared_expert_intermediate_size == 0

    qwen2 = ArchConfig.from_hf_config(_config(tiny_qwen2_moe_dir))
    assert qwen2.architecture == "qwen2_moe" and qwen2.attention_bias and not qwen2.o_proj_bias
    assert qwen2.moe is not None and not qwen2.moe.renormalize and qwen2.moe.weights_in_model_dtype
    assert qwen2.moe.sparse_layers == (0, 2)  # mlp_only_layers=[1]
    assert qwen2.moe.shared_expert_intermediate_size == 80 and qwen2.intermediate_size == 96

    qwen3 = ArchConfig.from_hf_config(_config(tiny_qwen3_moe_dir))
    assert qwen3.architecture == "qwen3_moe" and qwen3.qk_norm and qwen3.head_dim == 32
    assert qwen3.moe is not None and qwen3.moe.renormalize and qwen3.moe.expert_intermediate_size == 48


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(tiny_qwen2_moe_dir):
    cfg = _config(tiny_qwen2_moe_dir) | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert ArchConfig.from_hf_config(cfg).moe.sparse_layers == (1, 5)
    cfg = cfg | {"qkv_bias": False}
    assert not ArchConfig.from_hf_config(cfg).attention_bias


def test_dense_families_have_no_moe(tiny_qwen3_dir):
    assert ArchConfig.from_hf_config(_config(tiny_qwen3_dir)).moe is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "more than the number of experts"),
        ({"moe_intermediate_size": 0}, "intermediate size"),
        ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    ],
)
def test_unrunnable_moe_configs_are_refused_by_name(tiny_qwen3_moe_dir, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ArchConfig.from_hf_config(_config(tiny_qwen3_moe_dir) | change)


def test_qwen3_30b_a3b_benchmark_config_has_3b_active_parameters():
    """The dummy-weights benchmark config (built on the meta device: shapes, no memory): 30.5 B
    parameters, of which a decode step reads 3.35 B (what the MoE roofline counts)."""
    arch = ArchConfig.from_hf_config(_config(ROOT / "benchmarks/configs/qwen3-30b-a3b"))
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (128, 8)
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, 1.0, 16)
    model = MoECausalLM(arch, backend, device="meta", dtype=torch.bfloat16, max_positions=64)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    per_expert = 3 * arch.hidden_size * arch.moe.expert_intermediate_size * 2
    assert unread_expert_bytes(model) == arch.num_layers * (128 - 8) * per_expert
    assert total / 2 == pytest.approx(30.53e9, rel=1e-3)
    assert (total - unread_expert_bytes(model)) / 2 == pytest.approx(3.35e9, rel=1e-2)


# -- loading ------------------------------------------------------------------------------------------


def test_model_structure_follows_the_config(tiny_qwen2_moe_dir):
    model = _load(tiny_qwen2_moe_dir)
    assert isinstance(model, MoECausalLM)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoEBlock", "SwiGLUMLP", "SparseMoEBlock"]
    block = model.layers[0].mlp
    assert tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)  # [E, 2I, H]
    assert tuple(block.experts.down_proj.shape) == (8, 64, 32)  # [E, H, I]
    assert block.shared_expert is not None and block.shared_expert_gate.out_features == 1
    assert not model.fold_norm_weights()


def test_stacked_and_per_expert_checkpoints_load_the_same_weights(tiny_mixtral_dir, tiny_mixtral_stacked_dir):
    per_expert, stacked = _load(tiny_mixtral_dir), _load(tiny_mixtral_stacked_dir)
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_stacked_expert_tensors_match_transformers_in_memory_weights(tiny_qwen3_moe_dir):
    """Gate rows first, then up rows, as transformers 5 holds them: compared with the model it loads."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe_dir), dtype=torch.float32)
    ours = _load(tiny_qwen3_moe_dir)
    for layer in range(2):
        hf_experts = hf.model.layers[layer].mlp.experts
        assert torch.equal(ours.layers[layer].mlp.experts.gate_up_proj, hf_experts.gate_up_proj)
        assert torch.equal(ours.layers[layer].mlp.experts.down_proj, hf_experts.down_proj)


def test_a_missing_expert_tensor_is_named(tiny_qwen3_moe_dir):
    arch = ArchConfig.from_hf_config(_config(tiny_qwen3_moe_dir))
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, 1.0, 4)
    model = MoECausalLM(arch, backend)
    dropped = "model.layers.1.mlp.experts.5.up_proj.weight"
    weights = iter_safetensors_weights(tiny_qwen3_moe_dir, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        model.load_weights((n, t) for n, t in weights if n != dropped)


def test_expert_tensors_of_a_dense_layer_are_refused(tiny_qwen2_moe_dir):
    arch = ArchConfig.from_hf_config(_config(tiny_qwen2_moe_dir))
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, 1.0, 4)
    model = MoECausalLM(arch, backend)
    with pytest.raises(ValueError, match="layer 1 .* has no experts"):
        model.load_weights([("model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match="does not match"):
        model.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(33, 64))])


# -- logits against transformers ------------------------------------------------------------------


def test_one_chunk_matches_transformers(moe_dir):
    model = _load(moe_dir)
    prompt = _prompt(model.arch.vocab_size, 41, seed=1)
    harness = PagedHarness(model, seed=1)
    r = harness.add(prompt)
    harness.step([(r, len(prompt))])
    torch.testing.assert_close(harness.logits_of(r), _hf_logits(moe_dir, prompt), atol=1e-4, rtol=1e-4)


def test_chunks_and_decodes_mixed_in_batches_match_transformers(moe_dir):
    model = _load(moe_dir)
    vocab = model.arch.vocab_size
    prompts = [_prompt(vocab, 50, seed=2), _prompt(vocab, 30, seed=3), _prompt(vocab, 12, seed=4)]
    harness = PagedHarness(model, seed=2)
    a, b, c = (harness.add(p) for p in prompts)
    harness.step([(a, 30)])
    harness.step([(a, 10), (b, 6)])
    harness.step([(b, 13), (a, 1), (c, 7)])
    for _ in range(4):
        harness.step([(a, 1), (b, 1), (c, 1)])  # decode-only batches: 3 tokens over 8 experts
    harness.step([(b, 7), (a, 5), (c, 1)])
    for r, prompt in zip((a, b, c), prompts, strict=True):
        torch.testing.assert_close(harness.logits_of(r), _hf_logits(moe_dir, prompt), atol=1e-4, rtol=1e-4)


def test_bfloat16_forward_is_close_to_float32(tiny_qwen3_moe_dir):
    prompt = _prompt(1000, 24, seed=5)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        harness = PagedHarness(_load(tiny_qwen3_moe_dir, dtype), seed=5)
        r = harness.add(prompt)
        harness.step([(r, 16)])
        for _ in range(8):
            harness.step([(r, 1)])
        results[dtype] = harness.logits_of(r)
    assert torch.isfinite(results[torch.bfloat16]).all()
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float32], atol=0.3, rtol=0.05)


# -- the CPU experts path -------------------------------------------------------------------------------


def _experts_one_pair_at_a_time(x, gate_up, down, weights, ids):
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            h = gate_up[int(ids[t, k])] @ x[t]
            out[t] += weights[t, k] * (down[int(ids[t, k])] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def test_cpu_experts_run_only_the_experts_that_got_tokens(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 64, 32, 24
    x = torch.randn(5, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    ids = torch.tensor([[3, 40], [40, 7], [3, 63], [7, 3], [63, 40]])
    weights = torch.rand(5, 2, generator=gen)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    out = TorchMoEOps().experts(x, gate_up, down, weights, ids)
    assert len(calls) == 2 * 4  # gate/up and down for experts 3, 7, 40, 63 only
    torch.testing.assert_close(out, _experts_one_pair_at_a_time(x, gate_up, down, weights, ids))


def test_cpu_routing_matches_transformers_router(tiny_qwen3_moe_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe_dir), dtype=torch.float32)
    router = hf.model.layers[0].mlp.gate
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    _, hf_weights, hf_ids = router(x)
    ours = _load(tiny_qwen3_moe_dir).layers[0].mlp
    assert isinstance(ours, SparseMoEBlock)
    weights, ids = ours.moe_ops.route(ours.gate(x), 2, True, True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


def test_dense_models_keep_the_dense_class(tiny_qwen3_dir):
    model = _load(tiny_qwen3_dir)
    assert type(model) is CausalLM
