"""Quantized weights under tensor parallelism (gloo, two ranks).

- Quantized checkpoints (FP8 per tensor / channel, AWQ, GPTQ, compressed-tensors W4A16): each rank loads its part of every
  checkpoint tensor (column-parallel layers: their output rows' entries; row-parallel: their input
  columns' packed words, groups' zeros and scales); greedy tokens equal transformers' on the
  dequantized weights, logprobs close, as the one-process engine's do
  (tests/engine/test_quantized_models.py).
- FP8 mixture-of-experts checkpoints (Mixtral per tensor, Qwen2-MoE per channel with its shared
  expert): each rank holds its rows of every expert's gate / up and scales, its columns of each
  down; Qwen3-MoE quantized at load equals the one-rank FP8 engine (the down rows' scales from the
  whole row's absmax). 128x128 blocks that a rank's share of an expert would cut are refused.
- FP8 quantized at load (`--quantization fp8`): each rank quantizes its shard, and a row-parallel
  shard's per-channel scales come from the whole row's absmax, so the ranks hold exactly the one-rank
  model's FP8 values: greedy tokens equal the one-process FP8 engine's and logprobs agree to float
  rounding (per-shard scales would move them by ~0.1).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import SMALL_ENGINE
from tests.engine.hf_oracle import hf_greedy
from tests.model import quantized_checkpoints
from tokenmill import LLM, SamplingParams

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture

MAX_NEW = 8
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [300, 17, 42]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (list(c.token_ids), [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)])
        for c in (o.outputs[0] for o in outputs)
    ]


def _on_two_ranks(path: str, **options) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, tensor_parallel_size=2, **SMALL_ENGINE, **options)
    try:
        got = _greedy(llm)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()
    return got


# Per-tensor FP8 scales (whole on every rank), AWQ (words packed along the output rows), GPTQ (along the
# input columns, with g_idx renumbered per row-parallel shard), compressed-tensors pack-quantized (weights
# packed along the input columns, zero points along the output rows, weight_shape whole per part).
@pytest.mark.parametrize("layout", ["ct-fp8-tensor", "awq-g32", "gptq-g32-asym", "ct-w4a16-g32-asym"])
def test_quantized_checkpoint_equals_transformers_on_its_dequantized_weights(quantized_checkpoint, layout):
    ckpt = quantized_checkpoint(layout)
    for prompt, (tokens, logprobs) in zip(PROMPTS, _on_two_ranks(str(ckpt.path)), strict=True):
        expected, expected_lp = hf_greedy(str(ckpt.reference), prompt, MAX_NEW)
        assert tokens == expected, f"{len(prompt)}-token prompt"
        assert logprobs == pytest.approx(expected_lp, abs=1e-4)


def test_fp8_at_load_equals_one_rank(tp_qwen2_dir):
    path = str(tp_qwen2_dir)
    one = _greedy(LLM(path, quantization="fp8", **SMALL_ENGINE))
    assert [t for t, _ in one] != [t for t, _ in _greedy(LLM(path, **SMALL_ENGINE))], "FP8 changed nothing"
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        _on_two_ranks(path, quantization="fp8"), one, strict=True
    ):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize(("layout", "source"), [("ct-fp8-tensor", "mixtral"), ("ct-fp8-channel", "qwen2-moe")])
def test_fp8_moe_checkpoint_equals_transformers_on_two_ranks(quantized_checkpoint, layout, source):
    ckpt = quantized_checkpoint(layout, source=source)
    for prompt, (tokens, logprobs) in zip(PROMPTS, _on_two_ranks(str(ckpt.path)), strict=True):
        expected, expected_lp = hf_greedy(str(ckpt.reference), prompt, MAX_NEW)
        assert tokens == expected, f"{len(prompt)}-token prompt"
        assert logprobs == pytest.approx(expected_lp, abs=1e-4)


def test_fp8_moe_at_load_equals_one_rank(tmp_path, tiny_tokenizer):
    path = str(quantized_checkpoints.write_quant_source(tmp_path / "src", "qwen3-moe", tiny_tokenizer))
    one = _greedy(LLM(path, quantization="fp8", **SMALL_ENGINE))
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        _on_two_ranks(path, quantization="fp8"), one, strict=True
    ):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_block_fp8_experts_a_rank_would_cut_are_refused(quantized_checkpoint):
    ckpt = quantized_checkpoint("hf-fp8-block", source="qwen3-moe")  # experts of 128 rows: 64 a rank
    with pytest.raises(ValueError, match=r"experts' gate_proj / up_proj 64 output rows \(blocks of 128\)"):
        LLM(str(ckpt.path), tensor_parallel_size=2, **SMALL_ENGINE)
