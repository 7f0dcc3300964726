"""NCCL against the one-shot symmetric-memory all-reduce (distributed/symm_mem_all_reduce.py), per
message size, on N GPUs of one host: microseconds per call, each timed as a CUDA graph of `--calls`
back-to-back all-reduces (how a decode step issues them), and whether both give the exact sum.

    PYTHONPATH=src python benchmarks/all_reduce_microbench.py --tp 4

NVLink multicast stays off in every rank (NCCL_NVLS_ENABLE=0 and the others, the device's KINDS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SIZES_KIB = (8, 16, 32, 64, 128, 256, 512, 1024)


def _rank_main(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    from tokenmill.distributed import parallel_state
    from tokenmill.distributed.symm_mem_all_reduce import SymmMemAllReduce

    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    torch.cuda.set_device(rank)
    parallel_state.init_tensor_parallel(rank, args.tp, f"tcp://127.0.0.1:{port}", backend="nccl")
    one_shot = SymmMemAllReduce(torch.device("cuda", rank))
    dtype = getattr(torch, args.dtype)
    rows = []
    try:
        for kib in SIZES_KIB:
            numel = kib * 1024 // torch.empty((), dtype=dtype).element_size()
            # Small integers: every sum is exact in bf16, whatever order the ranks add in.
            x = torch.full((numel,), float(rank + 1), dtype=dtype, device="cuda")
            expected = float(sum(range(1, args.tp + 1)))

            def nccl(t: torch.Tensor) -> torch.Tensor:
                dist.all_reduce(t)
                return t

            row = {"kib": kib}
            for name, fn in (("nccl", nccl), ("one_shot", one_shot)):
                probe = fn(x.clone())  # eager: creates the communicator / buffer before capture
                row[f"{name}_exact"] = bool((probe == expected).all().item())
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        fn(x.clone())
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                inputs = [x.clone() for _ in range(args.calls)]
                with torch.cuda.graph(graph):
                    outs = [fn(t) for t in inputs]
                for t in inputs:
                    t.fill_(float(rank + 1))
                graph.replay()
                torch.cuda.synchronize()
                row[f"{name}_graph_exact"] = all(bool((o == expected).all().item()) for o in outs)
                for t in inputs:
                    t.fill_(float(rank + 1))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                start.record()
                for _ in range(args.repeats):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                row[f"{name}_us"] = 1000 * start.elapsed_time(end) / (args.repeats * args.calls)
                del graph
            rows.append(row)
            if rank == 0:
                print(
                    f"{kib:5d} KiB: NCCL {row['nccl_us']:6.1f} us, one-shot {row['one_shot_us']:6.1f} us "
                    f"(exact: NCCL {row['nccl_graph_exact']}, one-shot {row['one_shot_graph_exact']})",
                    flush=True,
                )
        if rank == 0:
            Path(result_path).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name(0)}))
    finally:
        faulthandler.cancel_dump_traceback_later()
        del one_shot
        parallel_state.destroy_tensor_parallel()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--calls", type=int, default=50, help="all-reduces per captured graph")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays timed")
    parser.add_argument("--hang-timeout", type=float, default=120.0)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    if args.tp < 2:
        parser.error(f"--tp must be >= 2, got {args.tp}")
    from tokenmill.bench.rank_processes import run_ranks
    from tokenmill.bench.results import write_result

    metrics = run_ranks(_rank_main, args, args.tp)
    config = {k: v for k, v in vars(args).items() if k not in ("result_dir", "result_name")}
    name = args.result_name or f"all-reduce-microbench-tp{args.tp}"
    print(
        f"wrote {write_result('all-reduce-microbench', config, metrics, out_dir=args.result_dir, name=name)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
