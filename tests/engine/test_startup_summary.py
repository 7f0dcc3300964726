"""The engine's start-up log says how many requests of max_model_len tokens the KV cache holds."""

from __future__ import annotations

import logging


def test_startup_logs_the_maximum_concurrency(tiny_llama_dir, caplog):
    from tokenmill import LLM

    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine_core"):
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=40, block_size=16, max_model_len=128)
    lines = [r.getMessage() for r in caplog.records if "maximum concurrency" in r.getMessage()]
    assert lines == ["KV cache holds 640 tokens: maximum concurrency for 128 tokens per request (max_model_len): 5.00x"]
