"""The one-shot symmetric-memory all-reduce's switch and its boundaries, on the CPU: the flag reaches
the parallel config, gloo groups never build it, and the one-shot path takes only what its kernel
takes (small contiguous CUDA tensors of bf16 / fp16 / fp32), the rest going to the backend.
Its GPU side (exact sums in and out of CUDA graphs, the speed against NCCL) is
benchmarks/all_reduce_microbench.py and tests/gpu/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import torch

from tokenmill.args import EngineArgs
from tokenmill.distributed import parallel_state
from tokenmill.distributed.symm_mem_all_reduce import DEFAULT_MAX_BYTES, SymmMemAllReduce
from tokenmill.engine.executor.multiproc import free_tcp_port


def test_the_flag_turns_it_off_and_it_is_on_by_default():
    assert EngineArgs(model="m").create_engine_config().parallel.custom_all_reduce is True
    off = EngineArgs(model="m", disable_custom_all_reduce=True).create_engine_config()
    assert off.parallel.custom_all_reduce is False


def test_a_gloo_group_never_builds_it_and_sums_through_gloo():
    parallel_state.init_tensor_parallel(
        0, 1, f"tcp://127.0.0.1:{free_tcp_port()}", backend="gloo", custom_all_reduce=True
    )
    try:
        assert parallel_state._ONE_SHOT is None
        x = torch.ones(4)
        assert parallel_state.all_reduce(x) is x  # one rank: as is
    finally:
        parallel_state.destroy_tensor_parallel()


def test_only_small_contiguous_cuda_tensors_of_its_dtypes_take_the_one_shot_path():
    # takes() reads no process group; a bare instance checks the rules without one.
    one_shot = SymmMemAllReduce.__new__(SymmMemAllReduce)
    one_shot.max_bytes = DEFAULT_MAX_BYTES
    assert not one_shot.takes(torch.ones(16))  # a CPU tensor: gloo's
    meta = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    assert not one_shot.takes(meta)  # not CUDA either
    if torch.cuda.is_available():
        small = torch.ones(64, 128, dtype=torch.bfloat16, device="cuda")
        assert one_shot.takes(small)
        assert not one_shot.takes(small.t())  # not contiguous
        assert not one_shot.takes(small.to(torch.int32))
        assert not one_shot.takes(torch.ones(DEFAULT_MAX_BYTES // 2 + 1, dtype=torch.bfloat16, device="cuda"))
