"""RoPE scaling types against transformers: config parsing (ArchConfig), frequencies and attention
factor (transformers' rope init functions), and the rotation itself (its RotaryEmbedding module and
apply_rotary_pos_emb), including partial rotary through our permuted head layout."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    partial_rotary_permutation,
    rope_frequencies,
)

HEADS, HEAD_DIM = 4, 16  # hidden 64
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.9 * i for i in range(HEAD_DIM // 2)]


def _config(family: str, rope: dict, **overrides):
    """A transformers config of `family` with rope parameters `rope` (as a config.json has them)."""
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "phi3": transformers.Phi3Config,
    }[family]
    kwargs = dict(
        vocab_size=100, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=256, rope_scaling=rope,
    )  # fmt: skip
    kwargs.update(overrides)
    return config_cls(**kwargs)


# (family, rope_scaling as in config.json, other config fields, positions the engine runs)
CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}, {}, 256),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 3.0}, {}, 256),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {}, 256),
    "yarn-qwen2.5": (
        "qwen2",
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"max_position_embeddings": 32768},
        300,
    ),
    "yarn-betas-mscale-untruncated": (
        "qwen2",
        {
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48, "beta_fast": 24,
            "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": False,
        },
        {},
        256,
    ),  # fmt: skip
    "yarn-attention-factor": (
        "qwen2",
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 0.8},
        {},
        256,
    ),
    # Phi-3: the top-level original_max_position_embeddings; factor = 512 / 64 for the attention factor.
    "longrope-short": (
        "phi3",
        {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        {"max_position_embeddings": 512, "original_max_position_embeddings": 64},
        64,
    ),
    "longrope-long": (
        "phi3",
        # (transformers 5 requires the original length inside a legacy "su" dict)
        {"type": "su", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 64},
        {"max_position_embeddings": 512, "original_max_position_embeddings": 64},
        200,
    ),
    "longrope-partial": (
        "phi3",
        {"type": "longrope", "short_factor": SHORT[:6], "long_factor": LONG[:6]},
        {"max_position_embeddings": 512, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75},
        200,
    ),
    "partial-plain": ("phi3", None, {"partial_rotary_factor": 0.5}, 100),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {},
        256,
    ),  # fmt: skip
}


def _arch_and_hf(case: str):
    family, rope, overrides, positions = CASES[case]
    config = _config(family, rope, **overrides)
    arch = ArchConfig.from_hf_config(
        {**config.to_dict(), "architectures": [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]}
    )
    return config, arch, positions


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1] is not None])
def test_frequencies_and_attention_factor_equal_transformers(case):
    config, arch, positions = _arch_and_hf(case)
    rope_type = config.rope_parameters["rope_type"]
    assert arch.rope_scaling["rope_type"] == rope_type
    # transformers' own choice for a forward over `positions` positions (longrope: short or long).
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=positions)
    rotary_dim = arch.rotary_dim or arch.head_dim
    inv_freq, factor = rope_frequencies(rotary_dim, arch.rope_theta, arch.rope_scaling, positions)
    torch.testing.assert_close(inv_freq, expected_freq, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    if rope_type in ("yarn", "longrope"):
        assert factor != 1.0  # the cases exercise a real attention factor


@pytest.mark.parametrize("case", list(CASES))
def test_rotation_equals_transformers(case):
    config, arch, positions = _arch_and_hf(case)
    hf_rotary = (Phi3RotaryEmbedding if arch.architecture == "phi3" else Qwen2RotaryEmbedding)(config)
    ours = RotaryEmbedding(
        arch.head_dim, positions, arch.rope_theta, arch.rope_scaling, rotary_dim=arch.rotary_dim
    )
    q = torch.randn(1, HEADS, positions, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(positions)[None]
    cos, sin = hf_rotary(q, position_ids)
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)  # [1, heads, T, head_dim]

    # Our layout: each head's dimensions in the permuted order (identity without partial rotary).
    order = partial_rotary_permutation(HEAD_DIM, arch.rotary_dim or HEAD_DIM)
    x = q[0].transpose(0, 1)[..., order]  # [T, heads, head_dim]
    ours_cos, ours_sin = ours(torch.arange(positions))
    got = apply_rotary(x, ours_cos, ours_sin)
    torch.testing.assert_close(got, expected[0].transpose(0, 1)[..., order], rtol=1e-5, atol=1e-5)


def test_partial_rotary_permutation_puts_rotated_pairs_half_a_head_apart():
    order = partial_rotary_permutation(16, 12)
    assert sorted(order.tolist()) == list(range(16))
    # checkpoint pair (i, i + 6) for i < 6 sits at (j, j + 8) in ours; dims 12..15 pass through.
    for j in range(6):
        assert (order[j].item(), order[j + 8].item()) == (j, j + 6)
    assert order[6:8].tolist() == [12, 13] and order[14:].tolist() == [14, 15]
    assert torch.equal(partial_rotary_permutation(8, 8), torch.arange(8))


def test_yarn_reaches_original_context_times_factor():
    _, arch, _ = _arch_and_hf("yarn-qwen2.5")
    assert arch.max_position_embeddings == 4 * 32768
    assert arch.rope_scaling["factor"] == 4.0
    assert rope_frequencies(HEAD_DIM, arch.rope_theta, arch.rope_scaling, 10)[1] == pytest.approx(
        0.1 * math.log(4) + 1
    )


def test_longrope_picks_factors_by_engine_context():
    _, arch, _ = _arch_and_hf("longrope-long")
    original = arch.rope_scaling["original_max_position_embeddings"]
    assert original == 64 and arch.rope_scaling["factor"] == 8.0
    short, short_factor = rope_frequencies(HEAD_DIM, arch.rope_theta, arch.rope_scaling, original)
    long, long_factor = rope_frequencies(HEAD_DIM, arch.rope_theta, arch.rope_scaling, original + 1)
    torch.testing.assert_close(short / long, torch.tensor(LONG) / torch.tensor(SHORT))
    # One attention factor for both, from max_position_embeddings / original = 8.
    assert short_factor == long_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(64)))


def test_dynamic_refuses_positions_past_its_table():
    _, arch, _ = _arch_and_hf("dynamic")
    with pytest.raises(ValueError, match="dynamic NTK RoPE"):
        RotaryEmbedding(HEAD_DIM, arch.max_position_embeddings + 1, arch.rope_theta, arch.rope_scaling)


def test_bad_rope_configs_are_refused_by_name():
    def parse(family: str, rope: dict | None, **cfg):
        config = _config(family, None).to_dict()
        config.pop("rope_parameters", None)
        config.update(cfg, rope_scaling=rope, architectures=[{"llama": "LlamaForCausalLM",
                                                              "phi3": "Phi3ForCausalLM"}[family]])
        return ArchConfig.from_hf_config(config)

    with pytest.raises(UnsupportedModelError, match="linear rope scaling is missing factor"):
        parse("llama", {"rope_type": "linear"})
    with pytest.raises(UnsupportedModelError, match="longrope rope scaling is missing long_factor"):
        parse("phi3", {"rope_type": "longrope", "short_factor": SHORT})
    with pytest.raises(UnsupportedModelError, match="short_factor has 6 entries; expected one per rotated pair, 8"):
        parse("phi3", {"rope_type": "longrope", "short_factor": SHORT[:6], "long_factor": LONG})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5 is not supported for llama"):
        parse("llama", None, partial_rotary_factor=0.5)
    with pytest.raises(UnsupportedModelError, match="'mrope' is not supported; supported: default, linear"):
        parse("llama", {"rope_type": "mrope"})
