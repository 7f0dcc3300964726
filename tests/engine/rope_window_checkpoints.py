"""Tiny random checkpoints for RoPE scalings and sliding windows: Phi-3 (LongRoPE, partial rotary,
sliding window), Mistral with its sliding window, Qwen2 with YaRN, Llama with linear scaling.

Written with transformers' save_pretrained like tests/conftest.py's (hidden 64, 2 layers, 4
heads of 16, 2 KV heads, the shared tiny tokenizer, weights spread as there); the CPU engine
tests and the GPU bf16 tests build them from these specs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import _randomize

# Per-frequency LongRoPE factors (one per rotated pair), different enough to change the output.
SHORT_FACTORS = [1.0 + 0.1 * i for i in range(8)]
LONG_FACTORS = [1.0 + 1.7 * i for i in range(8)]
WINDOW = 32

# name -> (transformers family, config overrides, the engine's max_model_len, shortest prompt)
SPECS: dict[str, tuple[str, dict, int, int]] = {
    # max_model_len 256 <= original 256: the short factors, as transformers uses for sequences
    # within the original context; attention factor from max_position_embeddings / original = 4.
    "phi3_longrope_short": (
        "phi3",
        {
            "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTORS, "long_factor": LONG_FACTORS},
        },
        256,
        3,
    ),  # fmt: skip
    # Phi-4-mini's shape: 3/4 of each head rotated, tied embeddings. max_model_len 256 > original 32:
    # the long factors, as transformers uses once a prompt exceeds 32 tokens (prompts start at 33).
    "phi3_longrope_long_partial": (
        "phi3",
        {
            "max_position_embeddings": 512, "original_max_position_embeddings": 32,
            "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTORS[:6], "long_factor": LONG_FACTORS[:6]},
        },
        256,
        33,
    ),  # fmt: skip
    # Qwen2.5's long-context recipe as its model card gives it.
    "qwen2_yarn": (
        "qwen2",
        {
            "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        },
        256,
        3,
    ),
    "llama_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 256, 3),
    # Every layer slides; prompts span several windows.
    "phi3_sliding": ("phi3", {"max_position_embeddings": 512, "sliding_window": WINDOW}, 256, 3 * WINDOW),
    "mistral_sliding": ("mistral", {"sliding_window": WINDOW}, 256, 3 * WINDOW),
}


def write_checkpoint(path: Path, name: str, tokenizer, seed: int) -> Path:
    import transformers

    family, overrides, _, _ = SPECS[name]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[family]
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
