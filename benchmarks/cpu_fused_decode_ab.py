"""A decode step with the layers in one C++ call vs the Python layer loop, in one process.

The default model (or --model) decodes `batch` requests; steps alternate between the fused op
(KernelConfig.fused_decode_layers) and the loop by flipping the model's switch between steps, so
both see the same host noise, the same KV contents and the same heap. Median step wall time of
each, and their ratio, per batch size; JSON into benchmarks/results/.

    PYTHONPATH=src taskset -c 1 python benchmarks/cpu_fused_decode_ab.py --batch-sizes 1,4,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM
from tokenmill.bench.decoding_batch import add_requests, step_until_decoding
from tokenmill.bench.results import DEFAULT_RESULTS_DIR, write_result


def timed_step(llm: LLM) -> float:
    started = time.perf_counter()
    llm.engine.step()
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--pairs", type=int, default=40, help="fused / loop step pairs per batch size")
    parser.add_argument("--result-dir", default=str(DEFAULT_RESULTS_DIR))
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=1024) if args.model else LLM(max_model_len=1024)
    model = llm.engine.runner.model
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = add_requests(llm, batch, args.input_len, 4 * args.pairs + 16, tag=f"b{batch}")
        step_until_decoding(llm, batch)
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * args.pairs + 4):
            fused = i % 2 == 0
            model.fuse_decode_layers = fused
            ms = timed_step(llm)
            if i >= 4:  # the first pair of each: warm-up
                times[fused].append(ms)
        model.fuse_decode_layers = True
        plan = model.ops._decode_plan
        if plan is None or plan.why_not is not None:
            raise SystemExit(f"the op does not serve this model: {None if plan is None else plan.why_not}")
        fused_ms, loop_ms = statistics.median(times[True]), statistics.median(times[False])
        row = {"batch": batch, "fused_step_ms": fused_ms, "loop_step_ms": loop_ms, "speedup": loop_ms / fused_ms}
        print(f"batch {batch}: fused {fused_ms:.2f} ms, loop {loop_ms:.2f} ms a step: {loop_ms / fused_ms:.3f}x")
        rows.append(row)
        llm.engine.abort_requests(ids)
        while llm.engine.has_work():
            llm.engine.step()
    path = write_result(
        "cpu-fused-decode-ab",
        {"model": args.model or "default", "input_len": args.input_len, "threads": args.threads, "pairs": args.pairs},
        {"by_batch": rows},
        args.result_dir,
        args.result_name,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
