"""Gemma 2 / Gemma 3 config.json files -> ArchConfig (model/arch_gemma.py), and what the Gemma
model builds from it: each layer's attention spec and RoPE table, the norms it loads, the fused
paths it takes or declines.

Configs come from transformers' own config classes (as save_pretrained writes them) and, for
the shapes of older Hub checkpoints, as dicts written out here.
"""

from __future__ import annotations

import pytest

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import SUPPORTED_ROPE_TYPES, ArchConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def _hf_dict(config, architecture: str) -> dict:
    return config.to_dict() | {"architectures": [architecture]}


def _gemma2_dict(**overrides) -> dict:
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
        max_position_embeddings=512, **overrides,
    )  # fmt: skip
    return _hf_dict(config, "Gemma2ForCausalLM")


def test_gemma2_config():
    arch = ArchConfig.from_hf_config(_gemma2_dict())
    assert arch.architecture == "gemma2"
    assert arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.attention_scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    assert arch.sliding_windows == (16, None, 16, None)  # transformers: even layers slide
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)  # Gemma2Config's defaults
    assert arch.tie_word_embeddings and not arch.qk_norm
    assert arch.rope_theta == 10000.0 and arch.rope_scaling is None and arch.local_rope_theta is None


def test_gemma2_soft_caps_can_be_off():
    arch = ArchConfig.from_hf_config(_gemma2_dict(attn_logit_softcapping=None, final_logit_softcapping=None))
    assert arch.attn_logit_softcap is None and arch.final_logit_softcap is None


def test_gemma3_config_as_transformers_5_writes_it():
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=24, attn_logit_softcapping=50.0,
        max_position_embeddings=4096,
    )  # fmt: skip
    arch = ArchConfig.from_hf_config(_hf_dict(config, "Gemma3ForCausalLM"))
    assert arch.architecture == "gemma3" and arch.qk_norm
    # Every sixth layer global (sliding_window_pattern 6), and with it the RoPE table per type.
    assert arch.sliding_windows == (24, 24, 24, 24, 24, None, 24)
    assert (arch.rope_theta, arch.local_rope_theta) == (1_000_000.0, 10_000.0)
    # transformers' Gemma 3 attention ignores attn_logit_softcapping; so do we.
    assert arch.attn_logit_softcap is None and arch.final_logit_softcap is None
    assert arch.attention_scale == pytest.approx(256**-0.5)  # Gemma3TextConfig's query_pre_attn_scalar


def test_gemma3_config_in_the_older_hub_layout():
    """google/gemma-3-1b-it's config.json shape: rope_theta / rope_local_base_freq /
    sliding_window_pattern, no layer_types, no rope_parameters."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": [1, 106],
    }  # fmt: skip
    arch = ArchConfig.from_hf_config(cfg)
    full = [i for i, w in enumerate(arch.sliding_windows) if w is None]
    assert full == [5, 11, 17, 23] and set(arch.sliding_windows) == {512, None}
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert arch.eos_token_ids == (1, 106) and arch.tie_word_embeddings


def test_gemma3_conditional_generation_text_config_takes_transformers_defaults():
    """A Gemma3ForConditionalGeneration config.json keeps a sparse text_config: the keys it leaves
    out take Gemma3TextConfig's defaults."""
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106],
    }  # fmt: skip
    arch = ArchConfig.from_hf_config(cfg)
    assert (arch.vocab_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (262208, 8, 4, 256)
    assert arch.attention_scale == pytest.approx(256**-0.5)
    assert arch.max_position_embeddings == 131072 and arch.num_layers == 34
    assert arch.sliding_windows[:6] == (1024,) * 5 + (None,)
    assert arch.eos_token_ids == (1, 106)


@pytest.mark.skipif(
    "linear" not in SUPPORTED_ROPE_TYPES, reason="linear RoPE scaling comes with the phi branch (rotary.py)"
)
def test_gemma3_linear_rope_scaling_applies_to_the_global_layers_only():
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "model_type": "gemma3_text",
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    }  # fmt: skip
    arch = ArchConfig.from_hf_config(cfg)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "linear"
    assert arch.rope_scaling["factor"] == 8.0
    assert arch.local_rope_theta == 10_000.0 and arch.local_rope_scaling is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": [SLIDING, FULL]}, "layer_types must list 4"),
    ],
)
def test_what_the_gemma_model_cannot_run_is_refused(overrides, message):
    cfg = _gemma2_dict() | overrides
    with pytest.raises(UnsupportedModelError, match=message):
        ArchConfig.from_hf_config(cfg)


def test_the_model_gives_each_layer_its_spec_rope_and_float32_norms(tmp_path, tiny_tokenizer):
    """A window covering max_model_len never takes effect (plain attention), but the layer keeps
    its local RoPE table; norms hold 1 + w in float32; no norm folding; no decode RoPE inside the
    attention launch (Gemma 3's Q/K norms come between the projection and RoPE)."""
    import torch

    from tests.engine.gemma_checkpoints import write_gemma_checkpoint
    from tokenmill import LLM

    path = write_gemma_checkpoint(tmp_path / "g3", "gemma3", tiny_tokenizer, seed=1, sliding_window=64)
    for max_model_len, window in ((256, 64), (64, None)):
        llm = LLM(str(path), device="cpu", max_model_len=max_model_len, attention_backend="torch")
        model = llm.engine.runner.model
        specs = [layer.self_attn.layer_spec for layer in model.layers]
        assert [s.sliding_window for s in specs] == [window, window, None, window]
        assert all(s.logits_soft_cap is None for s in specs)
        assert [layer.uses_local_rope for layer in model.layers] == [True, True, False, True]
        assert not model.fuse_decode_rope  # Q/K norms sit between the projection and RoPE
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))
    layer = model.layers[1]
    assert layer.pre_feedforward_layernorm.weight.dtype == torch.float32
    prefix = "model.layers.1."
    ff_norm = stored[prefix + "pre_feedforward_layernorm.weight"]
    torch.testing.assert_close(layer.pre_feedforward_layernorm.weight, 1.0 + ff_norm)
    q_norm = stored[prefix + "self_attn.q_norm.weight"]
    torch.testing.assert_close(layer.self_attn.q_norm.weight, 1.0 + q_norm)
    torch.testing.assert_close(model.norm, 1.0 + stored["model.norm.weight"])
    assert not model.fold_norm_weights()
    assert float(model.embed_scale) == 8.0  # sqrt(64)
