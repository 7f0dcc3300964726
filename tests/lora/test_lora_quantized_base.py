"""LoRA wraps whatever linear method a layer has: on FP8 and INT4 (quantized at load) bases the
adapted layer's output is the quantized product plus exactly the adapter's x A^T B^T."""

from __future__ import annotations

import pytest

from tests.lora_adapters import assert_adapter_adds_its_product, write_peft_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return write_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("quant_lora") / "a", seed=41, r=8)


@pytest.mark.parametrize("quantization", [None, "fp8", "awq"])
def test_adapter_adds_to_the_quantized_product(tiny_llama_dir, adapter_dir, quantization):
    from tokenmill import LLM
    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
        quantization=quantization,
    )  # fmt: skip
    assert_adapter_adds_its_product(llm, adapter_dir, quantized=quantization is not None, tol=1e-4)
