"""The start-up warm-up of eager step shapes (worker/kernel_warmup.py). It runs on CUDA at every
engine start (the GPU tests cover that); here its batches are checked on the CPU runner, where
there are no CUDA graphs, so the --enforce-eager decode-only shapes run too."""

from __future__ import annotations

import torch

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.worker.kernel_warmup import warm_up_eager_steps


def test_warm_up_runs_each_shape_once_and_leaves_the_engine_as_it_was(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128)
    runner = llm.engine.runner
    assert runner.graph_runner is None
    model = runner.model
    real_forward, real_logits = model.forward, model.compute_logits
    steps = []

    def forward(input_ids, positions, kv_caches, meta):
        assert kv_caches is not runner.kv_caches, "the warm-up must not touch the engine's KV pool"
        assert meta.slot_mapping.eq(-1).all(), "warm-up K/V must be written nowhere"
        steps.append((len(input_ids), meta.num_reqs, meta.is_decode_only))
        return real_forward(input_ids, positions, kv_caches, meta)

    def compute_logits(hidden):
        steps.append(("logits", hidden.shape[0]))
        return real_logits(hidden)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(model, "compute_logits", compute_logits)
    before = [cache.clone() for cache in runner.kv_caches]
    warm_up_eager_steps(runner)
    assert steps == [
        (1, 1, False), ("logits", 1),  # a one-token prefill
        (3, 1, False), ("logits", 1),
        (6, 3, False), ("logits", 3),  # a 4-token chunk with two decodes
        (8, 1, False), ("logits", 1),
        (17, 2, False), ("logits", 2),
        (1, 1, True), ("logits", 1),  # decode-only, eager: one request, then three
        (3, 3, True), ("logits", 3),
    ]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    monkeypatch.undo()
    prompt = list(range(40, 60))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert (
        llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        == hf_greedy(str(tiny_llama_dir), prompt, 6)[0]
    )


def test_warm_up_skips_shapes_longer_than_the_context_limit(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=8)
    runner = llm.engine.runner
    lengths = []
    real_forward = runner.model.forward

    def forward(input_ids, positions, kv_caches, meta):
        lengths.append(int(meta.seq_lens_cpu.max()))
        return real_forward(input_ids, positions, kv_caches, meta)

    monkeypatch.setattr(runner.model, "forward", forward)
    warm_up_eager_steps(runner)
    assert lengths and max(lengths) <= 8


def test_scratch_step_batches_as_the_memory_profile_and_warm_up_need():
    """worker/scratch_step.py builds both the memory profile's prefill (query = whole sequence)
    and the warm-up's mixed batches (a 1-token query at the end of its sequence is a decode)."""
    from tokenmill.worker.scratch_step import scratch_step

    positions, meta = scratch_step([5, 3], [5, 3], 2, torch.device("cpu"), decode_only=False)
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert meta.query_start_loc.tolist() == [0, 5, 8] and meta.seq_lens.tolist() == [5, 3]
    assert (meta.num_actual_tokens, meta.num_reqs, meta.max_query_len, meta.max_seq_len) == (8, 2, 5, 5)
    assert meta.block_tables.tolist() == [[0, 1], [0, 1]]
    assert meta.slot_mapping.tolist() == [-1] * 8 and not meta.is_decode_only

    positions, meta = scratch_step([1, 1], [4, 6], 2, torch.device("cpu"), decode_only=True)
    assert positions.tolist() == [3, 5] and meta.max_query_len == 1 and meta.is_decode_only
