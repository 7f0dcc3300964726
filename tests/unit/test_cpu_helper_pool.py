"""The few-row kernels' helper thread (kernels/cpu/csrc/helper_pool.h): it takes chunks only while
it is free, every chunk runs once, and the kernels that use it (the int8-activation product, the
decode attention) write the same bits with it as without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.test_cpu_quant_gemv import TYPES, random_blocks
from tokenmill.kernels.cpu.build import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available()[0], reason="the CPU kernels cannot be built here")


@pytest.fixture(params=[1, 2], ids=["1-torch-thread", "2-torch-threads"])
def one_torch_thread(request):
    """The engines' settings on a small machine, where the helper runs: one torch thread (serving)
    or two (offline); restored afterwards (the helper off, the thread count as it was)."""
    from tokenmill.kernels.cpu.build import load_cpu_kernels

    load_cpu_kernels()
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield torch.ops.tokenmill_cpu
    torch.ops.tokenmill_cpu.set_helper_threads(0)
    torch.set_num_threads(threads)


def test_without_the_helper_every_chunk_runs_on_the_caller(one_torch_thread):
    ops = one_torch_thread
    ops.set_helper_threads(0)
    assert ops.helper_threads() == 0
    assert ops.helper_pool_probe(16, 200) == 16


def test_the_helper_takes_chunks_and_each_runs_once(one_torch_thread):
    ops = one_torch_thread
    ops.set_helper_threads(1)
    assert ops.helper_threads() == 1
    # 16 chunks of 2 ms: a helper that wakes at all takes some of them. It may be late when the
    # machine is busy, so a few tries; the probe itself checks that the job finished (it returns).
    on_caller = [ops.helper_pool_probe(16, 2000) for _ in range(5)]
    assert all(0 <= c <= 16 for c in on_caller)
    assert min(on_caller) < 16, f"the helper never took a chunk: {on_caller}"


def test_a_job_of_one_chunk_and_of_none_run_inline(one_torch_thread):
    ops = one_torch_thread
    ops.set_helper_threads(1)
    assert ops.helper_pool_probe(1, 10) == 1
    assert ops.helper_pool_probe(0, 10) == 0


def test_small_calls_stay_on_the_caller(one_torch_thread):
    """Kernels share a call with the helper only from 2^16 multiply-adds (a tiny model's products
    and attention would pay a wake-up for microseconds of work), and never with it off."""
    ops = one_torch_thread
    ops.set_helper_threads(1)
    assert not ops.helper_pool_used_for(2**16 - 1)
    assert ops.helper_pool_used_for(2**16)
    assert ops.helper_pool_used_for(576 * 576)  # SmolLM2-135M's smallest product, one row
    ops.set_helper_threads(0)
    assert not ops.helper_pool_used_for(2**30)


def test_set_helper_threads_takes_zero_or_one(one_torch_thread):
    with pytest.raises(RuntimeError, match="0 or 1 helper threads"):
        one_torch_thread.set_helper_threads(2)


def _int8_or_skip() -> None:
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available

    if not int8_available():
        pytest.skip("the int8-activation kernel needs AVX-512 VNNI or AVX2")


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", [(1000, 576, 1), (3072, 576, 2), (577, 1536, 4), (49152 // 16, 576, 1)])
def test_int8_product_is_the_same_with_the_helper(one_torch_thread, name: str, n: int, k: int, m: int) -> None:
    """Rows are split in chunks (1/32 of them, >= 64, a multiple of 4, a ragged last one) between the
    caller and the helper; each output is computed by one thread as before: the same bits."""
    _int8_or_skip()
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    ops = one_torch_thread
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n + k + m)
    blocks = torch.from_numpy(vnni_rows(random_blocks(rng, qtype, n, k), code))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    for bits in (8, 16):
        ops.set_helper_threads(0)
        alone = ops.quant_linear_int8(x, blocks, code, bits)
        ops.set_helper_threads(1)
        for _ in range(3):
            assert torch.equal(ops.quant_linear_int8(x, blocks, code, bits), alone)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq_lens", [[1], [200], [37, 300], [5, 64, 129, 700]])
def test_decode_attention_is_the_same_with_the_helper(one_torch_thread, cache_dtype, seq_lens) -> None:
    """A step of up to 4 decode rows shares its tasks (one a KV head with so few rows) with the
    helper; each task is computed by one thread as before: the same bits."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    _attention_same_with_and_without_helper(one_torch_thread, gen, [1] * len(seq_lens), seq_lens, cache_dtype, 16)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, m", [(3072, 576, 8), (577, 1536, 33), (960, 576, 130)])
def test_batched_product_is_the_same_with_the_helper(one_torch_thread, name: str, n: int, k: int, m: int) -> None:
    """The batched VNNI product's panels are shared in ~16 chunks (a ragged last one); each panel
    is computed by one thread as before: the same bits."""
    from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    if not gemm_vnni16_available():
        pytest.skip("the batched 16-bit kernel needs AVX-512 VNNI or AVX2")
    ops = one_torch_thread
    qtype, code = TYPES[name]
    rng = np.random.default_rng(n + k + m)
    blocks = torch.from_numpy(vnni_rows(random_blocks(rng, qtype, n, k), code))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))

    def product() -> torch.Tensor:
        out = torch.full((m, n), float("nan"))
        ops.quant_gemm_vnni16(out, x, blocks, code)
        return out

    ops.set_helper_threads(0)
    alone = product()
    assert not alone.isnan().any()
    ops.set_helper_threads(1)
    for _ in range(3):
        assert torch.equal(product(), alone)


def test_a_large_mixed_attention_step_is_the_same_with_the_helper(one_torch_thread) -> None:
    """More than 4 requests (decode rows and prefill chunks): runs of consecutive tasks go to the
    caller and the helper; the same bits."""
    gen = torch.Generator().manual_seed(3)
    query_lens = [1] * 20 + [17, 40, 5]
    seq_lens = [int(s) for s in torch.randint(1, 400, (20,), generator=gen)] + [60, 40, 300]
    _attention_same_with_and_without_helper(one_torch_thread, gen, query_lens, seq_lens, torch.float16, 64)


def test_the_helper_starts_where_the_process_runs_one_or_two_torch_threads(one_torch_thread, monkeypatch) -> None:
    """Auto: on with one or two torch threads on a machine of >= 2 cores (the serving and offline
    engines there), off with more; TOKENMILL_CPU_HELPER_THREAD overrides."""
    import os

    from tokenmill.kernels.cpu.build import _configure_helper_thread

    ops = one_torch_thread
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("TOKENMILL_CPU_HELPER_THREAD", raising=False)
    torch.set_num_threads(1)
    _configure_helper_thread()
    assert ops.helper_threads() == (1 if cores >= 2 else 0)
    torch.set_num_threads(2)
    _configure_helper_thread()
    assert ops.helper_threads() == (1 if cores >= 2 else 0)
    torch.set_num_threads(3)
    _configure_helper_thread()
    assert ops.helper_threads() == 0
    monkeypatch.setenv("TOKENMILL_CPU_HELPER_THREAD", "1")
    _configure_helper_thread()
    assert ops.helper_threads() == 1
    torch.set_num_threads(1)
    monkeypatch.setenv("TOKENMILL_CPU_HELPER_THREAD", "0")
    _configure_helper_thread()
    assert ops.helper_threads() == 0


def _attention_same_with_and_without_helper(ops, gen, query_lens, seq_lens, cache_dtype, max_query_len) -> None:
    """Paged attention over a shuffled cache, once without the helper and three times with it:
    every output row written and the same bits each time."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    blocks_per = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks_per), generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    at = 0
    for r, b in enumerate(blocks_per):
        tables[r, :b] = order[at : at + b]
        at += b
    cache = torch.randn(2, sum(blocks_per), block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def attend() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, cache, starts, lens, tables, head_dim**-0.5, max_query_len, 0, 0.0, None)
        return out

    ops.set_helper_threads(0)
    alone = attend()
    assert not alone.isnan().any()
    ops.set_helper_threads(1)
    for _ in range(3):
        assert torch.equal(attend(), alone)
