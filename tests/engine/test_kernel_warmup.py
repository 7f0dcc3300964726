"""The start-up warm-up of eager step shapes (worker/kernel_warmup.py). It runs on CUDA at every
engine start (the GPU tests cover that); here its batches are checked on the CPU runner, where
there are no CUDA graphs, so the --enforce-eager decode-only shapes run too."""

from __future__ import annotations

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.worker.kernel_warmup import warm_up_eager_steps


def _assert_greedy_matches_transformers(llm, model_dir) -> None:
    """After a warm-up, the engine still decodes what transformers does (nothing it ran touched
    the engine's state)."""
    prompt = list(range(40, 60))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert (
        llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        == hf_greedy(str(model_dir), prompt, 6)[0]
    )


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
    _assert_greedy_matches_transformers(llm, tiny_llama_dir)


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


# -- the attention steps: planned from the Triton backend's own choices (no GPU needed) ----------

H100_SMS = 132  # the planner's split counts depend on the SM count; the CPU's pseudo count is 4


def _triton_planner(
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    *,
    max_model_len: int = 4096,
    max_num_seqs: int = 256,
    budget: int = 8192,
    graphs: bool = True,
    layers: tuple = (),
    kv_cache_dtype: torch.dtype = torch.bfloat16,
    piecewise_max_tokens: int = 0,
):
    """(limits, variants) as warm_up_eager_steps plans them for a TritonPagedBackend of these
    shapes on an H100 (Llama-3.1-8B's by default), with CUDA graphs of the default sizes, and
    piecewise graphs (no fused RoPE) for the other steps up to `piecewise_max_tokens`."""
    from tokenmill.attention.backend import PLAIN_ATTENTION
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.worker.cuda_graphs import default_capture_sizes
    from tokenmill.worker.kernel_warmup import StepLimits, step_variants

    backend = TritonPagedBackend(num_heads, num_kv_heads, head_dim, head_dim**-0.5, 16)
    backend._num_sms = H100_SMS
    sizes = ()
    if graphs:  # what prepare_for_capture fixes (it needs CUDA)
        sizes = tuple(default_capture_sizes(max_num_seqs))
        backend._graph_max_reqs = sizes[-1]
        backend._graph_max_context_len = -(-max_model_len // 16) * 16
    variants = step_variants(
        backend.kernel_variants,
        list(layers) or [PLAIN_ATTENTION],
        kv_cache_dtype=kv_cache_dtype,
        device=torch.device("cpu"),
        fused_rope=lambda step: step.graph or step.num_tokens > piecewise_max_tokens,
    )
    return StepLimits(max_model_len, max_num_seqs, budget, sizes), variants


def _compiled_at_start_up(limits, variants, steps) -> frozenset:
    """The variants the warm-up's steps and the graph capture (a decode-only step of each captured
    size, planned for the longest context) launch."""
    from tokenmill.worker.kernel_warmup import WarmupStep

    captured = [
        WarmupStep(num_decodes=size, decode_seq_len=limits.max_model_len, decode_only=True, graph=True)
        for size in limits.graph_sizes
    ]
    return frozenset().union(*(variants(step) for step in [*steps, *captured]))


def _dense_serving_steps(limits):
    """Far more of the steps the scheduler can make than the planner looks at."""
    from tokenmill.worker.kernel_warmup import WarmupStep

    longest, max_seqs = limits.max_model_len, limits.max_num_seqs
    chunk_limit = min(limits.max_num_batched_tokens, longest)
    contexts = sorted({*range(1, longest + 1, max(97, longest // 50)), 127, 128, 129, 255, 256, 257, 600, longest})
    for chunk in sorted({*range(2, 300), 511, 512, 513, 1000, 2047, 2048, 4095, chunk_limit}):
        if chunk <= chunk_limit:
            yield WarmupStep(((chunk, chunk),))
            yield WarmupStep(((chunk, min(longest, chunk + 700)),))  # a later chunk of a long prompt
            yield WarmupStep(((chunk, chunk), (3, 900)), 1, 2)
    for chunk in (2, 17, 512):
        for decodes in range(1, min(max_seqs - 1, limits.max_num_batched_tokens - chunk) + 1):
            for context in contexts:
                yield WarmupStep(((chunk, chunk),), decodes, context)
    for decodes in range(1, max_seqs + 1):
        for context in contexts:
            yield WarmupStep(num_decodes=decodes, decode_seq_len=context, decode_only=True)
        # a prompt's last token as a one-token chunk among decodes: decode-only, not a graph
        yield WarmupStep(((1, 300),), decodes - 1, 700, decode_only=True)


LLAMA_8B = {}
SHAPES = {
    "llama-3.1-8b": LLAMA_8B,
    "llama-8b-piecewise": {"piecewise_max_tokens": 2048},
    "llama-8b-eager": {"graphs": False},
    "mha-64-heads": {"num_heads": 16, "num_kv_heads": 16, "head_dim": 64, "max_num_seqs": 100},
    "head-dim-256-fp8-cache": {"num_heads": 16, "num_kv_heads": 8, "head_dim": 256, "max_model_len": 8192},
    "long-context": {"max_model_len": 131072, "max_num_seqs": 64, "budget": 2048},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_no_serving_step_launches_an_attention_variant_the_start_up_missed(shape):
    from tokenmill.worker.kernel_warmup import plan_warmup_steps

    kwargs = dict(SHAPES[shape])
    if shape == "head-dim-256-fp8-cache":
        kwargs["kv_cache_dtype"] = torch.float8_e4m3fn
    limits, variants = _triton_planner(**kwargs)
    steps = plan_warmup_steps(limits, variants, eager_decode=not limits.graph_sizes)
    compiled = _compiled_at_start_up(limits, variants, steps)
    for step in _dense_serving_steps(limits):
        missing = variants(step) - compiled
        assert not missing, (step, missing)


def test_sliding_window_layers_get_their_own_split_counts_warmed():
    """A sliding layer plans its splits for its window, and compiles with SLIDING (and a soft
    cap, sinks) set: its variants are warmed beside the full layers'."""
    from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec
    from tokenmill.worker.kernel_warmup import plan_warmup_steps

    layers = (PLAIN_ATTENTION, AttentionLayerSpec(sliding_window=128, sinks=torch.zeros(32)))
    limits, variants = _triton_planner(layers=layers)
    steps = plan_warmup_steps(limits, variants)
    compiled = _compiled_at_start_up(limits, variants, steps)
    assert {v.sliding for v in compiled} == {False, True}
    for step in _dense_serving_steps(limits):
        assert variants(step) <= compiled, step


def test_warm_up_plan_covers_each_tile_size_split_count_and_batch_kind():
    """Llama-3.1-8B shapes on an H100: the decode flavour of mixed batches with and without
    split-KV (each split count up to the largest), with one request and with several, the
    prefill flavour at each tile size, and decode-only batches of one and several requests;
    a realistic step (40 decodes at ~600 tokens and a new 512-token prompt) among them."""
    from tokenmill.attention.triton_paged import choose_num_kv_splits
    from tokenmill.kernels.triton.paged_attention import decode_tile_config, prefill_tile_config
    from tokenmill.worker.kernel_warmup import WARMUP_STEPS, WarmupStep, plan_warmup_steps

    limits, variants = _triton_planner(**LLAMA_8B)
    steps = plan_warmup_steps(limits, variants)
    planned = steps[len(WARMUP_STEPS) :]
    assert steps[: len(WARMUP_STEPS)] == list(WARMUP_STEPS)
    assert 0 < len(planned) <= 6, planned  # a few steps, not one per variant
    compiled = _compiled_at_start_up(limits, variants, steps)
    prefill = {v.config for v in compiled if not v.decode}
    assert prefill == {prefill_tile_config(4, 128, n) for n in range(2, 8193)}
    assert len(prefill) == 4  # 16, 32, 64 and 128 rows
    mixed_decode = {(v.config, v.splits_pad) for v in compiled if v.decode and not v.all_decode}
    most_splits = choose_num_kv_splits(1, 8, 4096, H100_SMS)
    assert most_splits == 32
    one_req, several = decode_tile_config(4, 128, 1), decode_tile_config(4, 128, 2)
    assert one_req != several
    assert mixed_decode == {(one_req, 1)} | {(several, 1 << k) for k in range(6)}
    # The planned steps are mixed batches whose decodes split (the graphs warmed decode-only ones).
    assert all(not s.decode_only and s.num_decodes >= 1 for s in planned)
    assert {max(v.splits_pad for v in variants(s)) for s in planned} >= {2, 4, 8, 16, 32}
    decode_only = {(v.config, v.rope) for v in compiled if v.all_decode}
    assert decode_only == {(one_req, True), (several, False)}
    realistic = WarmupStep(((512, 512),), num_decodes=40, decode_seq_len=600)
    assert variants(realistic) <= compiled
    assert any(v.splits_pad == 2 for v in variants(realistic))


def test_kernel_variants_are_what_the_backend_launches(monkeypatch):
    """TritonPagedBackend.kernel_variants (what the warm-up plans with) lists exactly the launches
    forward / forward_decode_with_rope make for a step (recorded at the launch, on the CPU)."""
    from tokenmill.attention.backend import PLAIN_ATTENTION, AttentionLayerSpec
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.kv_fp8 import is_fp8_kv
    from tokenmill.kernels.triton import paged_attention as pa
    from tokenmill.worker.scratch_step import scratch_step

    launched = []

    def record(self, config, num_q_programs, decode, num_kv_splits, min_tiles=1, rope=None, all_decode=False):
        layer = self.layer
        launched.append(
            pa.KernelVariant(
                decode, config, pa._next_power_of_2(num_kv_splits),
                decode and num_kv_splits > 1 and self.fused_merge, decode and all_decode, rope is not None,
                is_fp8_kv(self.kv_cache.dtype), layer.sliding_window is not None,
                layer.soft_cap_log2 is not None, layer.sinks is not None,
            )
        )  # fmt: skip

    monkeypatch.setattr(pa._Launch, "attention", record)
    heads, kv_heads, dim = 8, 2, 16
    backend = TritonPagedBackend(heads, kv_heads, dim, 0.25, 16)
    backend._num_sms = H100_SMS
    cpu = torch.device("cpu")
    window = AttentionLayerSpec(sliding_window=64, logits_soft_cap=30.0, sinks=torch.zeros(heads))
    cases = [  # (query_lens, seq_lens, layer, multi_token_decode)
        ([5], [5], PLAIN_ATTENTION, False),
        ([40, 1, 1], [40, 3000, 20], PLAIN_ATTENTION, False),
        ([1, 9], [700, 9], window, False),
        ([1], [2000], PLAIN_ATTENTION, False),
        ([1, 1, 1], [2000, 100, 5], PLAIN_ATTENTION, False),
        ([1, 1], [2000, 100], window, False),
        # speculative verification steps: in the decode launch, and (a 9-token query) not
        ([3, 3], [900, 40], PLAIN_ATTENTION, True),
        ([2], [3000], window, True),
        ([8, 8, 8], [2000, 100, 5], PLAIN_ATTENTION, True),
        ([9, 2], [900, 40], PLAIN_ATTENTION, True),
    ]
    every = set()
    for dtype in (torch.float32, torch.float8_e4m3fn):
        for query_lens, seq_lens, layer, multi_token_decode in cases:
            decode_only = max(query_lens) == 1
            blocks = -(-max(seq_lens) // 16)
            _, meta = scratch_step(query_lens, seq_lens, blocks, cpu, decode_only)
            meta.multi_token_decode = multi_token_decode
            tokens = sum(query_lens)
            q = torch.zeros(tokens, heads, dim)
            k = v = torch.zeros(tokens, kv_heads, dim)
            cache = torch.zeros(2, blocks, 16, kv_heads, dim, dtype=dtype)
            launched.clear()
            if backend.supports_fused_decode_rope(meta):
                table = torch.zeros(4096, dim)
                positions = torch.tensor([s - 1 for s in seq_lens])
                backend.forward_decode_with_rope(q, k, v, positions, table, table, cache, meta, layer=layer)
            else:
                backend.forward(q, k, v, cache, meta, kv_already_stored=True, layer=layer)
            planned = backend.kernel_variants(
                num_reqs=len(query_lens),
                num_decodes=query_lens.count(1),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                kv_cache_dtype=dtype,
                device=cpu,
                layer=layer,
                multi_token_decode=multi_token_decode,
            )
            assert tuple(launched) == planned, (query_lens, seq_lens, layer, dtype)
            every.update(planned)
    assert len({v.splits_pad for v in every}) >= 3 and {v.rope for v in every} == {False, True}
    assert {v.config.block_q for v in every if v.decode} == {1, 2, 4, 8}  # the multi-token decodes' tiles


def test_warm_up_runs_the_planned_attention_steps_over_a_one_block_scratch_pool(tiny_llama_dir, monkeypatch):
    """With a backend that lists its kernel variants, the warm-up also runs the planned steps:
    long contexts (more blocks than the scratch pool holds: the table cycles through it) and,
    without graphs, decode-only batches; the engine's KV pool is untouched and generation exact."""
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.worker import kernel_warmup

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=512, max_num_seqs=8)
    runner = llm.engine.runner
    arch = runner.arch
    planner = TritonPagedBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, 1.0, runner.block_size)
    planner._num_sms = H100_SMS
    monkeypatch.setattr(runner.attn_backend, "kernel_variants", planner.kernel_variants, raising=False)
    seen = []
    real_forward = runner.model.forward

    def forward(input_ids, positions, kv_caches, meta):
        assert kv_caches is not runner.kv_caches and meta.slot_mapping.eq(-1).all()
        assert all(cache.shape[1] == kernel_warmup.SCRATCH_BLOCKS for cache in kv_caches)
        seen.append((meta.num_reqs, meta.max_query_len, int(meta.max_seq_len), meta.is_decode_only))
        return real_forward(input_ids, positions, kv_caches, meta)

    monkeypatch.setattr(runner.model, "forward", forward)
    before = [cache.clone() for cache in runner.kv_caches]
    kernel_warmup.warm_up_eager_steps(runner)
    limits = kernel_warmup.runner_limits(runner)
    variants = kernel_warmup.attention_variants(runner, lambda step: None)  # (no piecewise graphs on the CPU)
    steps = kernel_warmup.plan_warmup_steps(limits, variants, eager_decode=True)
    assert len(seen) == len(steps) > len(kernel_warmup.WARMUP_STEPS) + len(kernel_warmup.EAGER_DECODE_STEPS)
    assert max(s[2] for s in seen) > runner.block_size * kernel_warmup.SCRATCH_BLOCKS
    assert any(decode_only and max_seq_len >= 256 for _, _, max_seq_len, decode_only in seen)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    monkeypatch.undo()
    _assert_greedy_matches_transformers(llm, tiny_llama_dir)
