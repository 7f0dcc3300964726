"""One process per tensor-parallel rank for the multi-GPU microbenchmarks (benchmarks/
profile_tp_decode.py, all_reduce_microbench.py): NVLink multicast off in every rank (the device's
KINDS.md), a free port for the group, and rank 0's metrics read back from a JSON file it writes."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def run_ranks(rank_main: Callable[..., None], args: Any, nprocs: int) -> dict:
    """Run `rank_main(rank, args, port, result_path)` in `nprocs` spawned processes; rank 0 writes
    its metrics (a JSON object) to `result_path`, which this returns."""
    os.environ.update(MULTICAST_OFF)  # inherited by the spawned ranks
    import torch.multiprocessing as mp

    from tokenmill.engine.executor.multiproc import free_tcp_port

    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "rank0.json")
        mp.start_processes(
            rank_main, args=(args, free_tcp_port(), result_path), nprocs=nprocs, start_method="spawn"
        )
        return json.loads(Path(result_path).read_text())
