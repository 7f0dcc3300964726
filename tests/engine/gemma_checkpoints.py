"""Tiny random Gemma 2 and Gemma 3 checkpoints written with transformers, for the Gemma tests.

Both: hidden 64, 4 layers, 4 heads of 16 (2 KV heads), query_pre_attn_scalar 24 (so the
attention scale is not head_dim's), the shared tiny tokenizer (tests/conftest.py), tied
embeddings, max_position_embeddings 512.

| builder            | what it exercises                                                             |
| gemma2             | sliding window 16 on layers 0 and 2, attention soft cap 1, final soft cap 1.5  |
| gemma3             | layer_types s, s, full, s with window 24; Q/K norms; local RoPE theta 10^4 vs   |
|                    | global 10^6; no soft caps (transformers' Gemma 3 applies none)                 |
| gemma3 multimodal  | the gemma3 text model inside a Gemma3ForConditionalGeneration with a tiny      |
|                    | SigLIP vision tower (weights under model.language_model.*)                     |

Norm weights are drawn around 0 (Gemma scales by 1 + w), so a loader that forgot the offset
fails; the embedding small (it is scaled by 8); the other weights as tests/conftest.py draws them.
The soft caps are small so that they change the results (a final cap never changes greedy
tokens, tanh being monotonic, only logprobs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

EMBED_STD = 0.05
GEMMA2_WINDOW = 16
GEMMA3_WINDOW = 24
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _common(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def gemma2_config(tokenizer, **overrides):
    import transformers

    kwargs = _common(tokenizer) | dict(
        sliding_window=GEMMA2_WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=1.5
    )
    return transformers.Gemma2Config(**(kwargs | overrides))


def gemma3_text_config(tokenizer, **overrides):
    import transformers

    kwargs = _common(tokenizer) | dict(
        sliding_window=GEMMA3_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    )
    return transformers.Gemma3TextConfig(**(kwargs | overrides))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:  # Gemma applies 1 + w
            param.copy_(torch.empty_like(param).uniform_(-0.3, 0.3, generator=gen))
        elif name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name or "lm_head" in name:
            # Gemma multiplies the embedding by sqrt(hidden) = 8: this keeps it from drowning the
            # layers' contributions (greedy output would repeat the prompt's last token).
            param.copy_(torch.randn(param.shape, generator=gen) * EMBED_STD)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def write_gemma_checkpoint(path: Path, family: str, tokenizer, seed: int, **overrides) -> Path:
    """A tiny random `family` ("gemma2", "gemma3", "gemma3-multimodal") checkpoint + tokenizer."""
    import transformers

    torch.manual_seed(seed)
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(gemma2_config(tokenizer, **overrides))
    elif family == "gemma3":
        model = transformers.Gemma3ForCausalLM(gemma3_text_config(tokenizer, **overrides))
    elif family == "gemma3-multimodal":
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )  # fmt: skip
        config = transformers.Gemma3Config(
            text_config=gemma3_text_config(tokenizer, **overrides), vision_config=vision,
            mm_tokens_per_image=4, boi_token_index=3, eoi_token_index=4, image_token_index=5,
        )  # fmt: skip
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown family {family!r}")
    model = model.to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory, tiny_tokenizer):
    """A test module uses it with `tiny_gemma2_dir = gemma_checkpoints.tiny_gemma2_dir`."""
    return write_gemma_checkpoint(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", tiny_tokenizer, seed=11)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, tiny_tokenizer):
    return write_gemma_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", tiny_tokenizer, seed=12)
