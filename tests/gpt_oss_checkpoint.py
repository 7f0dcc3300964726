"""A tiny random gpt-oss checkpoint written with transformers (`save_pretrained`).

hidden 64, 4 heads / 2 KV heads of 16, 4 layers alternating sliding (window 16) / full, 8 experts
top-2 of intermediate size 32, YaRN RoPE (factor 4 over 128 positions, truncate false as the
published configs), the shared tiny tokenizer, fp32. On top of conftest._randomize's spread, the
experts' gate_up weights are 10x wider so that the clamped SwiGLU's limit (7) cuts some
activations, and the sinks are O(1) so that they move the attention weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import _randomize

GPT_OSS_WINDOW = 16
GPT_OSS_CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=GPT_OSS_WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
)


def build_tiny_gpt_oss(tokenizer, seed: int, **overrides):
    """The random transformers model (fp32, eval) the checkpoint is written from."""
    import transformers

    kwargs = dict(
        GPT_OSS_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kwargs)).to(torch.float32).eval()
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                param.mul_(10.0)
            elif name.endswith("self_attn.sinks"):
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def write_tiny_gpt_oss_checkpoint(path: Path, tokenizer, seed: int, **overrides) -> Path:
    model = build_tiny_gpt_oss(tokenizer, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_gpt_oss_checkpoint(tmp_path_factory.mktemp("tiny_gpt_oss"), tiny_tokenizer, seed=31)
