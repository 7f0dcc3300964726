"""The all-reduce's share of a tensor-parallel decode step (issue 22, run 3).

Starts one process per rank (torch.multiprocessing; NCCL on GPUs, gloo on the CPU), each building
its ModelRunner as a tensor-parallel worker does, then runs the same hand-built decode steps on
every rank (tokenmill.bench.decode_steps: `--batch` requests at `--context` tokens):
- step_ms: wall time of one runner step with CUDA graphs as served (rank 0, median);
- an eager step under torch.profiler on every rank; rank 0 reports the summed durations of its
  device kernels (CPU ops on the CPU) by name, and the collectives' share of them: NCCL's kernels
  (`nccl...`) on GPUs, `gloo:*` ops on the CPU. The eager step launches the same kernels as the
  graph but pays the launches; the share is of kernel time, which graphs do not change.

    PYTHONPATH=src python benchmarks/profile_tp_decode.py --model benchmarks/configs/llama-3.1-70b --tp 2
    PYTHONPATH=src python benchmarks/profile_tp_decode.py --model DIR --tp 2 --device cpu   # gloo

NVLink multicast stays off in every rank (NCCL_NVLS_ENABLE=0 and the others, as the device's
KINDS.md asks), set here before the ranks start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Kernel / op names that are collectives: NCCL's kernels, gloo's ops, c10d's wrappers and the
# one-shot symmetric-memory all-reduce (`c10d::symmetric_memory::one_shot_all_reduce_kernel<...>`).
COLLECTIVE_MARKERS = ("nccl", "gloo:", "c10d::", "all_reduce")


def is_collective(name: str) -> bool:
    return any(marker in name.lower() for marker in COLLECTIVE_MARKERS)


def phase(rank: int, what: str) -> None:
    """A progress line per rank (stderr), so that a run cut off by its timeout says where it was."""
    print(f"[rank {rank}] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _rank_main(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    import dataclasses
    import faulthandler
    import json

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.args import EngineArgs, resolve_device_defaults
    from tokenmill.bench.decode_steps import uniform_decode_step
    from tokenmill.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from tokenmill.engine.engine_core import resolve_max_model_len
    from tokenmill.model.resolve import resolve_model
    from tokenmill.worker.model_runner import ModelRunner

    engine_args = EngineArgs(
        model=args.model, load_format=args.load_format, tensor_parallel_size=args.tp, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 8), enforce_eager=args.eager,
        enable_custom_all_reduce=args.enable_custom_all_reduce, **({"device": args.device} if args.device else {}),
    )  # fmt: skip
    config = resolve_device_defaults(engine_args.create_engine_config())
    on_gpu = config.device.startswith("cuda")
    if on_gpu:
        config = dataclasses.replace(config, device=f"cuda:{rank}")
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    torch.manual_seed(config.model.seed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    if on_gpu:
        # CUPTI's first start waits for the devices it attaches to (every visible GPU) to go idle;
        # started later, it can wait on a peer's NCCL kernel that waits on this rank: a deadlock
        # (pytorch#48987), and it can hang after CUDA graph captures. Started once here, before any
        # collective or capture, the later profile only turns activity recording back on.
        with profile(activities=activities):
            torch.cuda.synchronize()
    # A rank stuck in a collective prints every thread's stack and exits instead of hanging the run.
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    init_tensor_parallel(
        rank, args.tp, f"tcp://127.0.0.1:{port}", backend="nccl" if on_gpu else "gloo",
        custom_all_reduce=config.parallel.custom_all_reduce,
    )  # fmt: skip
    # A barrier that launches no GPU kernel (gloo over the same store): no rank starts or stops
    # the profiler while a peer's collective is in flight.
    cpu_barrier_group = torch.distributed.new_group(backend="gloo") if on_gpu else None

    def cpu_barrier() -> None:
        if cpu_barrier_group is not None:
            torch.distributed.barrier(group=cpu_barrier_group)

    try:
        resolved = resolve_model(config.model)
        max_model_len = resolve_max_model_len(
            config.model.max_model_len, resolved.arch.max_position_embeddings
        )
        runner = ModelRunner(config, resolved, max_model_len)
        runner.initialize_kv_cache()
        phase(rank, "KV cache and graphs ready")
        first, again = uniform_decode_step(
            args.batch, 1, args.context, runner.block_size, runner.arch.vocab_size, seed=1
        )
        runner.execute(first)
        phase(rank, "first step done")

        def sync() -> None:
            if on_gpu:
                torch.cuda.synchronize()

        for _ in range(3):
            runner.execute(again)
        sync()
        phase(rank, "warm-up steps done")
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            runner.execute(again)  # returns after the sampled ids reach the host
            times.append(1000 * (time.perf_counter() - started))
        graphs, runner.graph_runner = runner.graph_runner, None  # the eager step, for the profile
        runner.piecewise = None
        runner.execute(again)
        sync()
        phase(rank, "timed steps done; profiling eager steps")
        cpu_barrier()
        with profile(activities=activities) as prof:
            cpu_barrier()
            for _ in range(args.profile_steps):
                runner.execute(again)
            sync()
            cpu_barrier()
        phase(rank, "profile done")
        runner.graph_runner = graphs
        by_name: dict[str, float] = {}
        for event in prof.key_averages():
            # GPUs: the kernels' own events only (a CPU op's self device time counts the kernels
            # it launched again); CPUs: every op's self time.
            if on_gpu and event.device_type != DeviceType.CUDA:
                continue
            us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
            if us > 0:
                by_name[event.key] = by_name.get(event.key, 0.0) + us / 1000 / args.profile_steps
        if rank == 0:
            total = sum(v for k, v in by_name.items() if on_gpu or k != "ProfilerStep*")
            collective = sum(v for k, v in by_name.items() if is_collective(k))
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
            Path(result_path).write_text(json.dumps({
                "step_ms": statistics.median(times),
                "cuda_graphs": graphs is not None,
                "custom_all_reduce": config.parallel.custom_all_reduce and on_gpu,
                "kernel_ms_per_step": total,
                "collective_ms_per_step": collective,
                "collective_share": collective / total if total else 0.0,
                "top": [{"name": k, "ms_per_step": v} for k, v in top],
                "device": torch.cuda.get_device_name(rank) if on_gpu else "cpu",
            }))  # fmt: skip
    finally:
        faulthandler.cancel_dump_traceback_later()
        destroy_tensor_parallel()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None, help="cpu for gloo (default: the engine's)")
    parser.add_argument("--batch", type=int, default=1, help="requests per decode step")
    parser.add_argument("--context", type=int, default=512, help="tokens each request has computed")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (CUDA graphs)")
    parser.add_argument("--profile-steps", type=int, default=5, help="profiled eager steps")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs at all")
    parser.add_argument(
        "--enable-custom-all-reduce",
        action="store_true",
        help="small all-reduces through the one-shot kernel (as the engine flag)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=200.0,
        help="seconds after which a rank dumps its stacks and exits",
    )
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.context + 1 > args.max_model_len:
        parser.error(f"--context {args.context} needs --max-model-len above it")
    from tokenmill.bench.rank_processes import run_ranks
    from tokenmill.bench.results import write_result

    metrics = run_ranks(_rank_main, args, args.tp)
    print(
        f"TP={args.tp} batch {args.batch}: step {metrics['step_ms']:.2f} ms "
        f"({'CUDA graphs' if metrics['cuda_graphs'] else 'eager'}, "
        f"{'one-shot' if metrics['custom_all_reduce'] else 'NCCL or gloo'} all-reduce); eager-step kernels "
        f"{metrics['kernel_ms_per_step']:.2f} ms, of which collectives {metrics['collective_ms_per_step']:.2f} ms "
        f"= {100 * metrics['collective_share']:.1f} %"
    )
    for row in metrics["top"][:8]:
        print(f"  {row['ms_per_step']:8.3f} ms  {row['name'][:100]}")
    config = {k: v for k, v in vars(args).items() if k not in ("result_dir", "result_name")}
    name = args.result_name or f"tp-decode-profile-{Path(args.model).name}-tp{args.tp}-b{args.batch}"
    path = write_result("tp-decode-profile", config, metrics, out_dir=args.result_dir, name=name)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
