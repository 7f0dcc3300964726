"""This process's tensor-parallel rank and the collectives the sharded layers call.

A tensor-parallel worker (engine/executor/tp_worker.py) calls `init_tensor_parallel` once, before
it builds its model runner; the layers read `tp_rank()` / `tp_size()` when they are built. Every
other process (one-device engines, tests) never calls it and gets rank 0 of 1, where each
collective below returns its input untouched, so the one-device path pays nothing.

The group is torch.distributed's default one: gloo on the CPU, NCCL on CUDA devices (whose
collectives CUDA graphs capture like any kernel: the model runner captures each rank's graphs in
the same order, after an eager warm-up step has created the communicator). Every rank runs the
same code on the same step, so the collectives line up without any coordination beyond this
module. On NCCL, small all-reduces (decode steps) take a one-shot kernel over symmetric memory
instead (symm_mem_all_reduce.py) unless `custom_all_reduce` is off (--disable-custom-all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.distributed.symm_mem_all_reduce import SymmMemAllReduce


@dataclass(frozen=True, slots=True)
class TensorParallelState:
    rank: int = 0
    size: int = 1


_STATE = TensorParallelState()
_ONE_SHOT: SymmMemAllReduce | None = None  # NCCL groups with the custom all-reduce on


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    custom_all_reduce: bool = False,
) -> None:
    """Join the group of `size` ranks at `init_method` (tcp://host:port) as `rank`; `backend`: gloo
    for CPU tensors, nccl for CUDA ones (on the current CUDA device). `timeout_s` bounds a
    collective whose peers never come (gloo raises instead of waiting forever).
    `custom_all_reduce`: small CUDA all-reduces through the one-shot symmetric-memory kernel."""
    global _STATE, _ONE_SHOT
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the tensor-parallel size {size}")
    if size > 1:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        if custom_all_reduce and backend == "nccl":
            _ONE_SHOT = SymmMemAllReduce(torch.device("cuda", torch.cuda.current_device()))
    _STATE = TensorParallelState(rank, size)


def destroy_tensor_parallel() -> None:
    global _STATE, _ONE_SHOT
    _ONE_SHOT = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`: a row-parallel layer's partial outputs. Use the returned tensor:
    NCCL reduces `x` in place and returns it, the one-shot kernel returns a new tensor."""
    if _STATE.size > 1:
        if _ONE_SHOT is not None and _ONE_SHOT.takes(x):
            return _ONE_SHOT(x)
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise max of every rank's `x` (in place): a row-parallel layer's per-row absmax over
    its whole input, when each rank quantizes its shard of the columns at load."""
    if _STATE.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension: the vocab-parallel logits. Every
    rank gets them (each runner samples the same tokens from them; see broadcast_from_driver)."""
    if _STATE.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place): its sampled token ids are the step's, and every
    rank's runner feeds them into the next step, so no rank's RNG may drift from rank 0's."""
    if _STATE.size > 1:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest `value` of every rank: the KV pool's block count (each rank sizes its own)."""
    if _STATE.size == 1:
        return value
    # NCCL reduces CUDA tensors only (gloo CPU ones): the value travels on the backend's device.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
