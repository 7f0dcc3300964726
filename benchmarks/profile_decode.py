"""Where a decode step's time goes on the GPU: kernels vs launches vs Python, eager vs CUDA graphs.

For each batch size, `batch` requests with `input_len`-token prompts are prefilled, then decode
steps are timed four ways:
- step_ms: wall time of one whole engine step (schedule, inputs, forward, sample, sync, update);
- device_ms: GPU time of the forward alone (graph replay, or the eager forward + lm_head),
  between CUDA events; for eager this includes the GPU idling while Python launches kernels;
- kernel_ms: the sum of the kernels' own durations in an eager step (torch.profiler);
- kernels: how many kernels one eager forward launches.
So, per step: kernel_ms is real GPU work, device_ms - kernel_ms is launch-bound idling, and
step_ms - device_ms is host work (scheduler, batch building, sampling, the sync, bookkeeping).
It also counts host syncs per step besides the sampled-id fetch (torch.cuda.set_sync_debug_mode).

    PYTHONPATH=src python benchmarks/profile_decode.py --model benchmarks/configs/llama-3.1-8b
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from tokenmill import LLM
from tokenmill.bench.decoding_batch import add_requests, step_until_decoding
from tokenmill.bench.results import write_result
from tokenmill.bench.timing import cuda_ms
from tokenmill.worker.batch_inputs import build_host_batch


def wall_per_step(llm: LLM, steps: int) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        llm.engine.step()  # ends with the sampled-id sync
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _time_forward(runner, so, requests, repeats: int) -> float:
    """GPU ms of one forward (+ logits) on the inputs of `so` (its request states already
    updated by the runner), repeated back to back."""
    graphs = runner.graph_runner
    num_computed_tokens = so.batch_num_computed_tokens()
    num_scheduled_tokens = list(so.num_scheduled_tokens.values())
    with torch.inference_mode():
        if graphs is not None:
            key = graphs.graph_key(len(requests), 1)
            batch = build_host_batch(
                requests,
                num_computed_tokens,
                num_scheduled_tokens,
                runner.block_size,
                block_table_width=runner.max_blocks_per_req,
            )
            runner.build_metadata(batch, padded_reqs=key[0])

            def forward():
                graphs.replay(key)
        else:
            batch = build_host_batch(requests, num_computed_tokens, num_scheduled_tokens, runner.block_size)
            ids, pos, meta = runner.build_metadata(batch)

            def forward():
                runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta))

        # Repeats rewrite the same KV slots with the same values: the engine's own step follows.
        forward()
        torch.cuda.synchronize()
        return cuda_ms(forward, reps=repeats)


def forward_device_ms(llm: LLM, repeats: int = 20) -> float:
    """Times the forward of the engine's next decode step, then lets the step run as usual."""
    runner = llm.engine.runner
    timing: dict[str, float] = {}
    # What both the sync and the async engine reach, once the runner has applied the step's
    # scheduler output to its request states.
    real_launch = runner.launch

    def timed_launch(so, requests):
        timing["ms"] = _time_forward(runner, so, requests, repeats)
        return real_launch(so, requests)

    runner.launch = timed_launch
    try:
        llm.engine.step()
    finally:
        del runner.launch  # back to the class's method
    return timing["ms"]


def kernel_breakdown(llm: LLM, steps: int = 3) -> dict:
    """Kernel ms and launches per engine step (torch.profiler), with the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time if hasattr(event, "device_time") else event.cuda_time
        entry = by_name.setdefault(event.name[:90], [0.0, 0])
        entry[0] += us
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]
    return {
        "kernel_ms": sum(v[0] for v in by_name.values()) / 1000 / steps,
        "kernels_per_step": sum(v[1] for v in by_name.values()) / steps,
        "top": [(name, us / 1000 / steps, count / steps) for name, (us, count) in top],
    }


def syncs_per_step(llm: LLM, steps: int = 3) -> float:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                llm.engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # The runner exempts its one fetch of the sampled ids, so a lean step shows 0 here.
    return sum("called a synchronizing" in str(w.message) for w in caught) / steps


def profile_batch(llm: LLM, batch: int, input_len: int) -> dict[str, float]:
    runner = llm.engine.runner
    graphs = runner.graph_runner
    ids = add_requests(llm, batch, input_len, 2000, tag=f"b{batch}")
    step_until_decoding(llm, batch)
    result: dict[str, float] = {"batch": batch}
    for mode in ("graphs", "eager"):
        runner.graph_runner = graphs if mode == "graphs" else None
        wall_per_step(llm, 3)  # settle (and compile the eager split variants)
        result[f"{mode}_step_ms"] = wall_per_step(llm, 20)
        result[f"{mode}_device_ms"] = forward_device_ms(llm)
        result[f"{mode}_syncs_per_step"] = syncs_per_step(llm)
    for mode in ("graphs", "eager"):
        runner.graph_runner = graphs if mode == "graphs" else None
        try:
            breakdown = kernel_breakdown(llm)
        except Exception as exc:  # the profiler is a diagnostic: report why it failed and go on
            print(f"torch.profiler failed ({mode}): {type(exc).__name__}: {exc}")
            continue
        result[f"{mode}_kernel_ms"] = breakdown["kernel_ms"]
        result[f"{mode}_kernels_per_step"] = breakdown["kernels_per_step"]
        result[f"{mode}_top_kernels"] = breakdown["top"]
    runner.graph_runner = graphs
    llm.engine.abort_requests(ids)
    while llm.engine.has_work():
        llm.engine.step()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--quantization", default=None, help="as `serve --quantization` (e.g. fp8, quantized at load)")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, quantization=args.quantization)
    rows = [profile_batch(llm, int(b), args.input_len) for b in args.batch_sizes.split(",")]
    print(
        f"{torch.cuda.get_device_name(0)}, {args.model} shapes, {args.quantization or 'bf16'}, "
        f"{args.input_len}-token prompts"
    )
    print("batch | mode   | step ms | forward device ms | kernel ms | kernels | other syncs/step")
    for r in rows:
        for mode in ("graphs", "eager"):
            print(
                f"{r['batch']:5d} | {mode:6s} | {r[f'{mode}_step_ms']:7.2f} | {r[f'{mode}_device_ms']:17.2f} | "
                f"{r.get(f'{mode}_kernel_ms', float('nan')):9.2f} | "
                f"{r.get(f'{mode}_kernels_per_step', float('nan')):7.0f} | {r[f'{mode}_syncs_per_step']:.1f}"
            )
    for r in rows:
        print(f"top kernels per step, batch {r['batch']}, graphs (ms, launches):")
        for name, ms, count in r.get("graphs_top_kernels", []):
            print(f"  {ms:7.3f} {count:5.0f}  {name}")
    config = {
        "model": args.model,
        "load_format": "dummy",
        "input_len": args.input_len,
        "max_model_len": args.max_model_len,
        "quantization": args.quantization,
    }
    print(f"wrote {write_result('profile-decode', config, {'rows': rows}, out_dir=args.result_dir)}")


if __name__ == "__main__":
    main()
