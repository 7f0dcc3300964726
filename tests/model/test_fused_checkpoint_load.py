"""Checkpoints that store q/k/v and gate/up fused (Phi-3): the whole tensor loads into our merged
layers as its parts would, at every tensor-parallel size, and Phi3ForCausalLM names what a
checkpoint must hold."""

from __future__ import annotations

import pytest
import torch

from tests.engine.rope_window_checkpoints import write_checkpoint
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import ModelConfig
from tokenmill.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.registry import MODEL_CLASSES, resolve_model


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_qkv_and_gate_up_load_like_their_parts(tp_size):
    hidden, head_dim, heads, kv_heads, inter = 16, 4, 8, 2, 12
    q = _tensor(heads * head_dim, hidden, seed=1)
    k, v = _tensor(kv_heads * head_dim, hidden, seed=2), _tensor(kv_heads * head_dim, hidden, seed=3)
    gate, up = _tensor(inter, hidden, seed=4), _tensor(inter, hidden, seed=5)
    for rank in range(tp_size):
        place = {"tp_rank": rank, "tp_size": tp_size, "dtype": torch.float64}
        fused, parts = (QKVParallelLinear(hidden, head_dim, heads, kv_heads, **place) for _ in range(2))
        fused.weight_loader("weight", torch.cat((q, k, v)))
        for shard_id, part in zip("qkv", (q, k, v), strict=True):
            parts.weight_loader("weight", part, shard_id)
        assert torch.equal(fused.weight, parts.weight)
        fused_mlp, parts_mlp = (MergedColumnParallelLinear(hidden, (inter, inter), **place) for _ in range(2))
        fused_mlp.weight_loader("weight", torch.cat((gate, up)))
        parts_mlp.weight_loader("weight", gate, 0)
        parts_mlp.weight_loader("weight", up, 1)
        assert torch.equal(fused_mlp.weight, parts_mlp.weight)
    with pytest.raises(ValueError, match=r"has 60 rows; expected the parts' 32 \+ 8 \+ 8 = 48"):
        QKVParallelLinear(hidden, head_dim, heads, kv_heads).weight_loader("weight", _tensor(60, hidden, seed=6))


def test_phi3_checkpoint_names_its_fused_tensors(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file

    path = write_checkpoint(tmp_path, "phi3_longrope_short", tiny_tokenizer, seed=7)
    arch = resolve_model(ModelConfig(model=str(path))).arch
    assert arch.architecture == "phi3" and MODEL_CLASSES["phi3"] is Phi3ForCausalLM
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, 16)
    weights = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in weights
    partial = {n: t for n, t in weights.items() if n != "model.layers.1.mlp.gate_up_proj.weight"}
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.gate_up_proj.weight$"):
        Phi3ForCausalLM(arch, backend).load_weights(partial.items())
    Phi3ForCausalLM(arch, backend).load_weights(weights.items())
