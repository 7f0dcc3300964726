"""Multi-LoRA against transformers with each adapter merged (PEFT merge_and_unload), fp32 greedy."""

from __future__ import annotations

import pytest

from tests.lora_adapters import greedy_tokens, merged_model, write_peft_adapter
from tokenmill import SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [
    "The quick brown fox jumps over",
    "1 2 3 4 5 6 7 8",
    "Once upon a time in a land far away",
    "hello world, hello world, hello",
]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [
        write_peft_adapter(tiny_llama_dir, root / "a", seed=11, r=8),
        write_peft_adapter(tiny_llama_dir, root / "b", seed=12, r=4, targets=("q_proj", "v_proj", "down_proj")),
        write_peft_adapter(tiny_llama_dir, root / "c", seed=13, r=16, alpha=8, use_rslora=True),
    ]


def test_mixed_batch_equals_merged_transformers(tiny_llama_dir, adapters):
    from tokenmill import LLM

    llm = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
        max_num_batched_tokens=64,
    )  # fmt: skip
    loras = [LoRARequest(f"ad{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    per_prompt = [loras[0], None, loras[1], loras[2]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, lora_request=per_prompt)
    tokenizer = llm.get_tokenizer()
    differs_from_base = 0
    base = merged_model(tiny_llama_dir, None)
    for prompt, lora, out in zip(PROMPTS, per_prompt, outputs, strict=True):
        ids = tokenizer(prompt).input_ids
        oracle = merged_model(tiny_llama_dir, None if lora is None else lora.lora_path)
        expected = greedy_tokens(oracle, ids, 12)
        assert list(out.outputs[0].token_ids) == expected, (lora, prompt)
        if lora is not None and expected != greedy_tokens(base, ids, 12):
            differs_from_base += 1
    assert differs_from_base >= 2  # the adapters change the output, so the test can see them
    llm.engine.check_invariants()
