"""Where a CPU decode step's time goes, default model (SmolLM2-135M Q4_1 GGUF), offline engine.

For each batch size, `batch` requests with `input_len`-token prompts are prefilled, then:
- step_ms: median wall time of one whole engine step (schedule, inputs, forward, sample, update);
- a torch.profiler table of one step's CPU ops by self time (matmuls, the quantized GEMV,
  attention, norms, sampling, and what is left: Python between ops).
Run with --threads 1 and 2 to see the engine's torch thread count at work.

    PYTHONPATH=src python benchmarks/profile_cpu_decode.py --batch-sizes 1,32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill import LLM
from tokenmill.bench.decoding_batch import add_requests, step_until_decoding
from tokenmill.bench.results import write_result


def wall_per_step(llm: LLM, steps: int) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) of one step. On a shared machine the CPU time (all of this
    process's threads) moves less with other jobs' load than the wall time."""
    walls, cpus = [], []
    for _ in range(steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        llm.engine.step()
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - started_cpu)
    return 1000 * statistics.median(walls), 1000 * statistics.median(cpus)


def op_table(llm: LLM, steps: int, rows: int, by_shape: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) as prof:
        for _ in range(steps):
            llm.engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    if by_shape:
        table += "\n" + gemm_by_shape(prof, steps)
    return table


def gemm_by_shape(prof, steps: int) -> str:
    """The quantized products' self CPU time per step by weight shape (x [M, K], blocks [N, bytes])."""
    lines = ["quantized products by shape (self CPU ms a step, calls a step):"]
    for event in prof.key_averages(group_by_input_shape=True):
        if "quant_linear" not in event.key or not event.input_shapes:
            continue
        x_shape, w_shape = event.input_shapes[0], event.input_shapes[1]
        lines.append(
            f"  {event.key} x {x_shape} blocks {w_shape}: {event.self_cpu_time_total / 1000 / steps:.2f} ms, "
            f"{event.count / steps:.0f} calls"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--kernel-config", default="{}", help="JSON of KernelConfig fields")
    parser.add_argument("--no-table", action="store_true", help="step times only")
    parser.add_argument("--by-shape", action="store_true", help="also the quantized products by weight shape")
    parser.add_argument("--result-name", default=None, help="also write the step times to benchmarks/results/NAME.json")
    parser.add_argument("--result-dir", default="benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {"max_model_len": 1024, "kernel_config": json.loads(args.kernel_config)}
    llm = LLM(args.model, **kwargs) if args.model else LLM(**kwargs)
    steps = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = add_requests(llm, batch, args.input_len, 800, tag=f"b{batch}")
        step_until_decoding(llm, batch)
        wall_per_step(llm, 3)
        step_ms, cpu_ms = wall_per_step(llm, args.steps)
        print(
            f"== batch {batch}, {args.threads} threads: step {step_ms:.2f} ms wall ({1000 * batch / step_ms:.1f} tok/s), "
            f"{cpu_ms:.2f} ms CPU"
        )
        steps.append({"batch": batch, "step_ms": step_ms, "cpu_ms": cpu_ms, "tok_per_s": 1000 * batch / step_ms})
        if not args.no_table:
            print(op_table(llm, 5, args.rows, args.by_shape))
        llm.engine.abort_requests(ids)
        while llm.engine.has_work():
            llm.engine.step()
    if args.result_name:
        config = {"model": args.model or "default", "input_len": args.input_len, "threads": args.threads,
                  "steps": args.steps, "kernel_config": json.loads(args.kernel_config)}  # fmt: skip
        print(f"wrote {write_result('profile-cpu-decode', config, {'by_batch': steps}, args.result_dir, args.result_name)}")


if __name__ == "__main__":
    main()
