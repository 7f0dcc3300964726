"""Multi-LoRA on a CUDA GPU (Triton shrink / expand, CUDA graphs captured once with LoRA and once
without): a batch mixing three adapters and the base equals transformers with each adapter merged
(fp32 greedy), through decode graphs, piecewise graphs and eager steps."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.lora_adapters import greedy_tokens, merged_model, write_peft_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    return [
        write_peft_adapter(tiny_llama_dir, root / "a", seed=31, r=8),
        write_peft_adapter(tiny_llama_dir, root / "b", seed=32, r=4, targets=("q_proj", "v_proj", "down_proj")),
        write_peft_adapter(tiny_llama_dir, root / "c", seed=33, r=16, alpha=8, use_rslora=True),
    ]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_mixed_adapters_equal_merged_transformers(tiny_llama_dir, adapters, enforce_eager):
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 900) for _ in range(rng.randint(8, 60))] for _ in range(12)]
    loras = [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    per_prompt = [None if i % 4 == 3 else loras[i % 3] for i in range(len(prompts))]
    llm = LLM(
        str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256,
        max_num_seqs=16, enable_lora=True, max_loras=3, max_lora_rank=16, enforce_eager=enforce_eager,
        max_num_batched_tokens=128,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_prompt)
    oracles = {None: merged_model(tiny_llama_dir, None)}
    for lora in loras:
        oracles[lora.lora_int_id] = merged_model(tiny_llama_dir, lora.lora_path)
    for prompt, lora, out in zip(prompts, per_prompt, outputs, strict=True):
        model = oracles[None if lora is None else lora.lora_int_id]
        assert list(out.outputs[0].token_ids) == greedy_tokens(model, prompt, MAX_TOKENS), lora
    runner = llm.engine.executor.driver_runner
    if not enforce_eager:
        with_lora, without = runner._graph_variants[True][0], runner._graph_variants[False][0]
        assert with_lora.num_replays > 0  # decode steps with adapters replayed the LoRA graphs
        # Base-only requests afterwards replay the graphs without LoRA kernels.
        before = without.num_replays
        llm.generate([{"prompt_token_ids": prompts[0]}], params)
        assert without.num_replays > before
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage"] == 0.0


def test_bf16_adapter_close_to_fp32(tiny_llama_dir, adapters):
    """bf16 weights and slots: the first tokens agree with the fp32 run."""
    prompts = [[(7 * i + j) % 900 + 20 for j in range(30)] for i in range(8)]
    lora = LoRARequest("a", 1, str(adapters[0]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            str(tiny_llama_dir), device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=128,
            enable_lora=True, max_loras=1, max_lora_rank=16,
        )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
        results[dtype] = [list(o.outputs[0].token_ids)[:1] for o in outs]
        llm.engine.executor.driver_runner.release()
    agree = sum(a == b for a, b in zip(results["float32"], results["bfloat16"], strict=True))
    assert agree >= 6, results


@pytest.mark.parametrize("quantization", [None, "fp8", "awq"])
def test_adapter_adds_to_the_quantized_product_on_the_gpu(tiny_llama_dir, adapters, quantization):
    """bf16 kernels (FP8 W8A8 and INT4 quantized at load, residual in the epilogue): the Triton
    shrink / expand add exactly the adapter's product to the layer's own."""
    from tests.lora_adapters import assert_adapter_adds_its_product

    llm = LLM(
        str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_model_len=256, num_kv_blocks=64,
        enable_lora=True, max_loras=2, max_lora_rank=16, quantization=quantization, enforce_eager=True,
    )  # fmt: skip
    assert_adapter_adds_its_product(llm, adapters[0], quantized=quantization is not None, tol=3e-2)
