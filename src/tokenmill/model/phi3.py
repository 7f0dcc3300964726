"""Phi-3 / Phi-3.5-mini / Phi-4 / Phi-4-mini (`Phi3ForCausalLM`): Llama's decoder, stored fused.

What differs from Llama is read into ArchConfig (model/arch.py) and handled by the shared
layers: LongRoPE ("su" / "longrope", layers/rotary.py), a sliding window on every layer
(Phi-3-mini-4k: 2047), partial rotary (Phi-4-mini: 0.75 of each head), no biases. What is left is
the checkpoint's layout: each layer holds `self_attn.qkv_proj` (q, k, v rows in that order) and
`mlp.gate_up_proj` (gate rows, then up rows) as single tensors. They go whole into our merged
layers of the same names, which split them into their parts (MergedColumnParallelLinear's fused
load), so this class only names what a checkpoint must hold.
"""

from __future__ import annotations

from tokenmill.model.llama import CausalLM

_PHI3_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


class Phi3ForCausalLM(CausalLM):
    supports_piecewise_graphs = False  # not checked against piecewise CUDA graphs yet
    # Sharded as llama's: the fused qkv_proj / gate_up_proj tensors are split into their parts,
    # and each part is sharded as if loaded alone (MergedColumnParallelLinear.weight_loader).
    supports_tensor_parallel = True

    @property
    def checkpoint_layer_weights(self) -> tuple[str, ...]:
        return _PHI3_LAYER_WEIGHTS
