"""FastLauncher on CUDA: launches through the cached compiled kernel give what Triton's own
dispatch gives, and the cache never reuses a kernel across a specialization Triton makes."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fast_launch import FastLauncher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, stride, scale, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src_ptr + offsets * stride, mask=mask) * scale
    if ADD_ONE:
        values += 1.0
    tl.store(dst_ptr + offsets, values, mask=mask)


def _reference(src: torch.Tensor, n: int, stride: int, scale: float, add_one: bool) -> torch.Tensor:
    values = src[: n * stride : stride] * scale
    return values + 1.0 if add_one else values


@pytest.mark.parametrize("mode", ["1", "verify"])
def test_cached_launches_match_triton(monkeypatch, mode: str) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", mode)
    launcher = FastLauncher(_scaled_copy)
    base = torch.randn(4096, device="cuda", dtype=torch.float32)
    # Aligned and unaligned pointers, strides 1 / 16 / 3, sizes that are and are not multiples of 16,
    # both values of the defaulted constexpr, each case launched twice (a miss, then a hit).
    cases = [
        (base, 1024, 1, False),
        (base[1:], 1000, 1, False),  # 4-byte offset: not 16-byte aligned
        (base, 128, 16, True),
        (base[4:], 77, 3, False),
        (base, 1, 1, True),
    ]
    for src, n, stride, add_one in cases:
        for _ in range(2):
            dst = torch.empty(n, device="cuda", dtype=torch.float32)
            kwargs = {"BLOCK": 256}
            if add_one:
                kwargs["ADD_ONE"] = True
            launcher((triton.cdiv(n, 256),), src, dst, n, stride, 0.5, **kwargs)
            torch.testing.assert_close(dst, _reference(src, n, stride, 0.5, add_one), rtol=0, atol=0)
    assert launcher.hits == (len(cases) if mode == "1" else 0)
    # Keys finer than Triton's: each case got a compiled kernel of its own or a shared one, but a
    # key never maps to a kernel compiled for another specialization (verify mode raises if so).
    assert len(launcher.compiled) == len(cases)


def test_off_takes_tritons_path(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "0")
    launcher = FastLauncher(_scaled_copy)
    src = torch.randn(512, device="cuda")
    dst = torch.empty(512, device="cuda")
    for _ in range(3):
        launcher((2,), src, dst, 512, 1, 2.0, BLOCK=256)
    torch.testing.assert_close(dst, src * 2.0, rtol=0, atol=0)
    assert launcher.hits == 0 and not launcher.compiled


def test_cpu_tensors_fall_back(monkeypatch) -> None:
    """A launch with a CPU tensor is left to Triton (which rejects it), never cached."""
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "1")
    launcher = FastLauncher(_scaled_copy)
    with pytest.raises(Exception):  # noqa: B017 - Triton's own error for a host pointer
        launcher((1,), torch.zeros(16), torch.zeros(16, device="cuda"), 16, 1, 1.0, BLOCK=16)
    assert not launcher.compiled


def _mixed_step(num_layers: int, dtype: torch.dtype = torch.bfloat16):
    """A mixed step's metadata (one 96-token chunk on a 40-token prefix beside 7 decodes at
    ~300 tokens) and per-layer caches, q, k, v."""
    from tokenmill.bench.paged_batch import scattered_paged_batch

    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    query_lens, context_lens = [96] + [1] * 7, [40] + [300 + 13 * i for i in range(7)]
    meta, num_blocks = scattered_paged_batch(query_lens, context_lens, block, seed=1)
    n = sum(query_lens)
    layers = [
        (
            torch.randn(2, num_blocks, block, kv_heads, head_dim, device="cuda", dtype=dtype),
            torch.randn(n, heads, head_dim, device="cuda", dtype=dtype),
            torch.randn(n, kv_heads, head_dim, device="cuda", dtype=dtype),
            torch.randn(n, kv_heads, head_dim, device="cuda", dtype=dtype),
        )
        for _ in range(num_layers)
    ]
    return (heads, kv_heads, head_dim, block), meta, layers


@pytest.mark.parametrize("mode", ["1", "verify"])
def test_layers_replaying_a_recorded_step_match_fresh_launches(monkeypatch, mode: str) -> None:
    """The backend records the first layer's attention launches of a step and replays them for the
    others with their own cache, q and output: same bits as each layer computed on its own."""
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.triton import paged_attention as pa

    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", mode)
    (heads, kv_heads, head_dim, block), meta, layers = _mixed_step(4)
    fresh_caches = [cache.clone() for cache, *_ in layers]
    stepped = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
    hits_before = pa._ATTENTION_LAUNCH.hits
    replayed = [stepped.forward(q, k, v, cache, meta).clone() for cache, q, k, v in layers]
    if mode == "1":
        assert pa._ATTENTION_LAUNCH.hits - hits_before >= 2 * (len(layers) - 1)  # prefill + decode launches
    for i, (_, q, k, v) in enumerate(layers):
        alone = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
        expected = alone.forward(q, k, v, fresh_caches[i], meta)
        torch.testing.assert_close(replayed[i], expected, rtol=0, atol=0)
        torch.testing.assert_close(layers[i][0], fresh_caches[i], rtol=0, atol=0)  # the KV stores agree too


def test_replay_refuses_a_q_of_other_strides(monkeypatch) -> None:
    """A layer whose q differs in strides from the recorded one (or alignment) is launched afresh."""
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.triton.paged_attention import replay_paged_attention

    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "1")
    (heads, kv_heads, head_dim, block), meta, layers = _mixed_step(2)
    backend = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
    cache0, q0, k0, v0 = layers[0]
    backend.forward(q0, k0, v0, cache0, meta)
    ((recorded,),) = [records.launches.values() for records in backend._replay_memo.values()]
    cache1, q1, k1, v1 = layers[1]
    wide = torch.zeros(q1.shape[0], heads + 1, head_dim, device="cuda", dtype=q1.dtype)
    wide[:, :heads] = q1
    strided_q = wide[:, :heads]
    out = torch.empty_like(q1)
    assert not replay_paged_attention(recorded, out, strided_q, cache1)
    unaligned = torch.empty(q1.numel() + 1, device="cuda", dtype=q1.dtype)[1:].view_as(q1)
    unaligned.copy_(q1)
    assert not replay_paged_attention(recorded, out, unaligned, cache1)
    # Through the backend both still give the right answer (a fresh launch).
    expected = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block).forward(
        q1, k1, v1, cache1.clone(), meta
    )
    got = backend.forward(strided_q, k1, v1, cache1, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_hybrid_step_replays_each_group_and_swaps_sinks(monkeypatch) -> None:
    """A step of a hybrid model alternates two metadata objects (sliding and global layers, as
    Gemma 2/3 and gpt-oss do) and each layer has its own sinks: every layer after the first of its
    group replays, and gives the bits it gives launched on its own."""
    from tokenmill.attention import triton_paged
    from tokenmill.attention.backend import AttentionLayerSpec
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.bench.paged_batch import scattered_paged_batch

    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "1")
    replays: list[bool] = []
    replay = triton_paged.replay_paged_attention

    def counted_replay(*args, **kwargs) -> bool:
        replays.append(replay(*args, **kwargs))
        return replays[-1]

    monkeypatch.setattr(triton_paged, "replay_paged_attention", counted_replay)
    (heads, kv_heads, head_dim, block), global_meta, layers = _mixed_step(6, torch.bfloat16)
    # The sliding group's metadata: the same requests, its own (scattered) block tables and slots.
    sliding_meta, sliding_blocks = scattered_paged_batch(
        [96] + [1] * 7, [40] + [300 + 13 * i for i in range(7)], block, seed=2
    )
    assert sliding_blocks == layers[0][0].shape[1]
    specs = [
        (
            sliding_meta if i % 2 == 0 else global_meta,
            AttentionLayerSpec(
                sliding_window=64 if i % 2 == 0 else None,
                sinks=torch.randn(heads, device="cuda", dtype=torch.float32),
            ),
        )
        for i in range(len(layers))
    ]
    fresh_caches = [cache.clone() for cache, *_ in layers]
    stepped = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
    got = [
        stepped.forward(q, k, v, cache, meta, kv_already_stored=False, layer=spec).clone()
        for (cache, q, k, v), (meta, spec) in zip(layers, specs, strict=True)
    ]
    # Two layers record (the first of each group); the other four replay theirs, sinks swapped.
    assert replays == [True] * (len(layers) - 2)
    assert len(stepped._replay_memo) == 2
    for i, ((_, q, k, v), (meta, spec)) in enumerate(zip(layers, specs, strict=True)):
        alone = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
        expected = alone.forward(q, k, v, fresh_caches[i], meta, kv_already_stored=False, layer=spec)
        torch.testing.assert_close(got[i], expected, rtol=0, atol=0)


def test_replay_yields_to_a_profiler(monkeypatch) -> None:
    """While a profiler has set Triton's launch hooks, a recorded step is not replayed: every
    launch goes through Triton, which calls the hooks."""
    from tokenmill.attention.triton_paged import TritonPagedBackend

    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "1")
    (heads, kv_heads, head_dim, block), meta, layers = _mixed_step(3)
    backend = TritonPagedBackend(heads, kv_heads, head_dim, head_dim**-0.5, block)
    cache0, q0, k0, v0 = layers[0]
    backend.forward(q0, k0, v0, cache0, meta)  # records
    seen: list[str] = []
    knobs = triton.knobs.runtime
    monkeypatch.setattr(knobs, "launch_enter_hook", lambda metadata: seen.append(metadata.data["name"]))
    for cache, q, k, v in layers[1:]:
        backend.forward(q, k, v, cache, meta)
    assert seen.count("_paged_attention_kernel") >= 2 * (len(layers) - 1)
