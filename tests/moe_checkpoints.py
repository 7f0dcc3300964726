"""Tiny random mixture-of-experts checkpoints written with transformers (`save_pretrained`).

| fixture                     | family    | what it exercises                                                   |
| tiny_mixtral_dir            | mixtral   | 8 experts, top-2 renormalized, block_sparse_moe.experts.E.w1/w2/w3  |
| tiny_mixtral_stacked_dir    | mixtral   | the same weights saved stacked ([E, 2I, H] / [E, H, I], mlp.*)      |
| tiny_qwen2_moe_dir          | qwen2_moe | shared expert + sigmoid gate, top-2 not renormalized, q/k/v bias,   |
|                             |           | a dense layer among sparse ones (mlp_only_layers), 3 layers         |
| tiny_qwen3_moe_dir          | qwen3_moe | Q/K norm, head_dim 32, top-2 renormalized (norm_topk_prob)          |

Shared with tests/conftest.py's tiny models: the tokenizer, hidden 64, 4 heads, 2 KV heads, fp32,
max_position_embeddings 512, and the weight spread (conftest._randomize). Test modules import the
fixtures they use from here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import _randomize

MOE_FIXTURES = ["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir"]


def write_tiny_moe_checkpoint(
    path: Path, family: str, tokenizer, seed: int, *, stacked: bool = False, **overrides
) -> Path:
    """Write a tiny random `family` MoE checkpoint + tokenizer to `path`; `stacked` keeps the
    experts as transformers holds them in memory (save_original_format=False)."""
    import transformers

    config_cls, model_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    _randomize(model, seed)
    # save_original_format=False keeps transformers' in-memory (stacked) expert layout.
    model.save_pretrained(path, **({"save_original_format": False} if stacked else {}))
    tokenizer.save_pretrained(path)
    return path


_MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, head_dim=16, sliding_window=None)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", tiny_tokenizer, 21, **_MIXTRAL)


@pytest.fixture(scope="session")
def tiny_mixtral_stacked_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_moe_checkpoint(
        tmp_path_factory.mktemp("tiny_mixtral_stacked"), "mixtral", tiny_tokenizer, 21, stacked=True, **_MIXTRAL
    )


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_moe_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen2_moe"),
        "qwen2_moe",
        tiny_tokenizer,
        22,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=80,
        intermediate_size=96,  # the dense layer's
        mlp_only_layers=[1],
    )


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_moe_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3_moe"),
        "qwen3_moe",
        tiny_tokenizer,
        23,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=48,
        intermediate_size=96,
    )
