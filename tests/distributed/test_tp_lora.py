"""Multi-LoRA under tensor parallelism (gloo, two ranks): each rank holds its shard of every adapter
(column-parallel layers: B's rows; row-parallel: A's columns, the partial products summed by the
layer's all-reduce); greedy output equals transformers' with the adapter merged (PEFT), in a batch
mixing adapters and the base model; adapters load and unload on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import SMALL_ENGINE
from tests.lora_adapters import merged_model, write_peft_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

MAX_NEW = 8
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 44)), [300, 17, 42]]


@torch.no_grad()
def greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The argmax continuation, EOS included (tests.lora_adapters' suppresses EOS; ignore_eos does not)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def adapters(tp_llama_mqa_dir, tmp_path_factory):
    """Two adapters of the one-KV-head checkpoint (k/v B rows whole on every rank, replicated)."""
    root = tmp_path_factory.mktemp("tp_adapters")
    return [
        write_peft_adapter(tp_llama_mqa_dir, root / "a", seed=21, r=8),
        write_peft_adapter(tp_llama_mqa_dir, root / "b", seed=22, r=4, targets=("q_proj", "v_proj", "down_proj")),
    ]


def test_mixed_batch_equals_merged_transformers(tp_llama_mqa_dir, adapters):
    path = tp_llama_mqa_dir
    loras = [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    per_prompt = [loras[0], None, loras[1]]
    llm = LLM(str(path), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, **SMALL_ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=per_prompt)
        base = merged_model(path, None)
        differs_from_base = 0
        for prompt, lora, out in zip(PROMPTS, per_prompt, outputs, strict=True):
            oracle = base if lora is None else merged_model(path, lora.lora_path)
            expected = greedy_tokens(oracle, prompt, MAX_NEW)
            assert list(out.outputs[0].token_ids) == expected, (lora, prompt)
            if lora is not None and expected != greedy_tokens(base, prompt, MAX_NEW):
                differs_from_base += 1
        assert differs_from_base == 2, "an adapter left the output unchanged: the test cannot see it"
        # Removed on every rank (the ranks say they had it, then that they do not); a new load of the
        # same files under a new id gives the same tokens.
        assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
        reloaded = LoRARequest("ad0-again", 3, str(adapters[0]))
        again = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, lora_request=reloaded)
        assert list(again[0].outputs[0].token_ids) == list(outputs[0].outputs[0].token_ids)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()
