"""Quantized models on a CUDA GPU, through the FP8 / INT4 Triton kernels and CUDA graphs: greedy
tokens in bf16 agree with transformers' bf16 on the dequantized weights, and graphs and eager
agree with each other.

The engine's FP8 path also quantizes activations (per token) where transformers multiplies 16-bit
activations with the dequantized weights, so the two may part at a step whose best two logprobs
are close: allowed below `margin` (0.25 nats for W8A8, 0.1 for the 16-bit activations of W4A16),
never within the first 4 tokens; the chosen tokens' logprobs must stay close.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

from tests.model import quantized_checkpoints
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.linear import linear_layers
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture
MAX_NEW = 24
LAYOUTS = {  # layout -> allowed top-2 margin at a divergence
    "ct-fp8-channel": 0.25,
    "ct-fp8-block": 0.25,
    "hf-fp8-block": 0.25,
    "awq-g128": 0.1,
    "gptq-g32-sym-actorder": 0.1,
}


@functools.cache
def _hf_bf16(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()


def _hf_greedy(path: str, prompt: list[int]) -> tuple[list[int], list[float], list[float]]:
    """transformers' bf16 tokens, their logprobs, and each step's top-2 logprob margin."""
    model = _hf_bf16(path)
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    top2 = [lp.topk(2).values.tolist() for lp in logprobs]
    return tokens, [lp[t].item() for lp, t in zip(logprobs, tokens, strict=True)], [a - b for a, b in top2]


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 48))] for _ in range(count)]


def _greedy(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_greedy_agrees_with_transformers_on_the_dequantized_weights(quantized_checkpoint, layout):
    ckpt = quantized_checkpoint(layout)
    llm = LLM(str(ckpt.path), device="cuda", max_model_len=256, num_kv_blocks=128)
    model = llm.engine.runner.model
    assert any(isinstance(layer.method, QuantizedLinearMethod) for layer in linear_layers(model))
    diffs = []
    for prompt, completion in zip(*(p := _prompts(llm.info.vocab_size, 4, seed=5), _greedy(llm, p)), strict=True):
        tokens, expected_lps, margins = _hf_greedy(str(ckpt.reference), prompt)
        compared = MAX_NEW
        if completion.token_ids != tokens:
            i = next(i for i, (a, b) in enumerate(zip(completion.token_ids, tokens, strict=True)) if a != b)
            assert margins[i] < LAYOUTS[layout], (
                f"diverged at token {i} where transformers' top-2 margin is {margins[i]:.3f}"
            )
            compared = i
        assert compared >= 4, "diverged within the first 4 tokens"
        diffs += [abs(pos[t].logprob - lp) for pos, t, lp in
                  zip(completion.logprobs[:compared], tokens, expected_lps, strict=False)]  # fmt: skip
    assert max(diffs) < 0.3 and sum(diffs) / len(diffs) < 0.06, (max(diffs), sum(diffs) / len(diffs))
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.graph_runner.num_replays > 0
    llm.engine.check_invariants()


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama checkpoint whose layers fit 4-bit groups of 128."""
    return quantized_checkpoints.write_quant_source(tmp_path_factory.mktemp("src"), "llama", tiny_tokenizer)


@pytest.mark.parametrize("quantization", ["fp8", "awq", "gptq"])
def test_graphs_and_eager_agree_when_quantized_at_load(llama_source, quantization):
    prompts = _prompts(1000, 6, seed=9)
    outputs = []
    for eager in (False, True):
        llm = LLM(str(llama_source), device="cuda", max_model_len=256, num_kv_blocks=128,
                  quantization=quantization, enforce_eager=eager)  # fmt: skip
        outputs.append([c.token_ids for c in _greedy(llm, prompts)])
        llm.engine.check_invariants()
        del llm
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]
