"""`kv_cache_dtype`: its own option, carried to the KV pool the attention kernels read."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 2, 30, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POOL_BYTES = 8 * 2**20


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", max_model_len=128, kv_cache_memory=POOL_BYTES, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_auto_is_the_model_dtype_and_naming_it_changes_nothing(tiny_llama_dir, backend):
    auto = _llm(tiny_llama_dir, attention_backend=backend)
    runner = auto.engine.runner
    assert all(cache.dtype == torch.float32 for cache in runner.kv_caches)
    named = _llm(tiny_llama_dir, attention_backend=backend, kv_cache_dtype="float32")
    assert named.engine.info.num_kv_blocks == auto.engine.info.num_kv_blocks
    tokens = [out.outputs[0].token_ids for out in auto.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    again = [out.outputs[0].token_ids for out in named.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert tokens == again


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_16_bit_cache_under_a_float32_model_holds_twice_the_blocks_and_generates(tiny_llama_dir, backend):
    fp32 = _llm(tiny_llama_dir, attention_backend=backend)
    bf16 = _llm(tiny_llama_dir, attention_backend=backend, kv_cache_dtype="bfloat16")
    assert all(cache.dtype == torch.bfloat16 for cache in bf16.engine.runner.kv_caches)
    assert bf16.engine.info.num_kv_blocks == 2 * fp32.engine.info.num_kv_blocks
    outputs = bf16.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [12, 12]
    bf16.engine.check_invariants()
    assert bf16.engine.scheduler.kv.usage == 0.0  # every block back in the pool


def test_backends_declare_the_kv_cache_dtypes_they_read():
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    reference = TorchReferenceBackend(4, 2, 8, 8**-0.5, 16)
    assert reference.supports_kv_cache_dtype(torch.bfloat16, torch.float32)
    assert reference.supports_kv_cache_dtype(torch.float8_e4m3fn, torch.bfloat16)  # scaled FP8 (test_fp8_kv_cache.py)
    assert not reference.supports_kv_cache_dtype(torch.float8_e5m2, torch.bfloat16)
    triton_paged = pytest.importorskip("tokenmill.attention.triton_paged")
    triton = triton_paged.TritonPagedBackend(4, 2, 8, 8**-0.5, 16)
    assert triton.supports_kv_cache_dtype(torch.bfloat16, torch.bfloat16)
    assert not triton.supports_kv_cache_dtype(torch.float32, torch.bfloat16)  # q and K tiles must match
    assert triton.supports_kv_cache_dtype(torch.float8_e4m3fn, torch.bfloat16)  # widened to q's dtype


def test_the_kernel_config_reaches_the_attention_backend(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, kernel_config={"min_kv_tokens_per_split": 32})
    assert llm.engine.runner.attn_backend.kernel.min_kv_tokens_per_split == 32
