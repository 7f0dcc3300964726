"""Tiny checkpoints whose heads 2 and 3 ranks can split (tensor parallelism's tests)."""

from __future__ import annotations

import pytest

from tests.conftest import write_tiny_checkpoint

# A small KV pool: allocating the CPU default (1 GiB) per rank would cost more than the test.
SMALL_ENGINE = {"device": "cpu", "max_model_len": 128, "num_kv_blocks": 64}
# vocab 1001 (the tokenizer's 1000 + 1): 2 and 3 ranks both need padding rows.
TP_SHAPES = {
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_attention_heads": 6,
    "head_dim": 16,
    "vocab_size": 1001,
}


@pytest.fixture(scope="session")
def tp_qwen2_dir(tmp_path_factory, tiny_tokenizer):
    """q/k/v biases (sharded with their rows), untied lm_head, 6 KV heads: split over the ranks."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_qwen2"),
        "qwen2",
        tiny_tokenizer,
        seed=11,
        num_key_value_heads=6,
        **TP_SHAPES,
    )


@pytest.fixture(scope="session")
def tp_llama_mqa_dir(tmp_path_factory, tiny_tokenizer):
    """One KV head (replicated on every rank), tied embeddings (the lm_head shares the vocab shard)."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_llama_mqa"), "llama", tiny_tokenizer, seed=12, num_key_value_heads=1,
        tie_word_embeddings=True, **TP_SHAPES,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tp_gemma2_dir(tmp_path_factory, tiny_tokenizer):
    """Sliding window 16 on every other layer, attention and final soft caps, tied embeddings scaled
    by sqrt(hidden); vocab 1001: the soft cap runs on logits gathered past the padding rows."""
    from tests.engine.gemma_checkpoints import write_gemma_checkpoint

    return write_gemma_checkpoint(
        tmp_path_factory.mktemp("tp_gemma2"), "gemma2", tiny_tokenizer, seed=31, vocab_size=1001
    )


@pytest.fixture(scope="session")
def tp_gemma3_dir(tmp_path_factory, tiny_tokenizer):
    """Sliding / global layers with their own RoPE tables, Q/K norms (whole head_dim on each rank)."""
    from tests.engine.gemma_checkpoints import write_gemma_checkpoint

    return write_gemma_checkpoint(tmp_path_factory.mktemp("tp_gemma3"), "gemma3", tiny_tokenizer, seed=32)


@pytest.fixture(scope="session")
def tp_phi3_dir(tmp_path_factory, tiny_tokenizer):
    """Fused qkv_proj / gate_up_proj tensors, partial rotary (3/4 of each head), LongRoPE, tied."""
    from tests.engine.rope_window_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tp_phi3"), "phi3_longrope_long_partial", tiny_tokenizer, seed=33)
