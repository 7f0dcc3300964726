"""Where a mixed step's time goes: one 512-token prefill beside N decodes, against N decodes alone.

    PYTHONPATH=src python benchmarks/mixed_step_profile.py --model benchmarks/configs/llama-3.1-8b --decodes 100

Drives the EngineCore by hand with synchronous steps (each step's wall time is its own): fills
N requests until they all decode, times decode-only steps, then steps that admit one new prompt
among the decodes. For each kind prints the median wall time and the host time until the step's
kernels were launched (a profiler pass lists the top CUDA kernels and CPU ops of one mixed step).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--decodes", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--trace", default=None, help="write the profiled mixed step's Chrome trace here")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.messages import EngineCoreRequest

    llm = LLM(args.model, load_format="dummy", max_model_len=4096, async_scheduling=args.async_scheduling)
    from tokenmill.kernels.jit_compiles import JitCompiles

    compiles = JitCompiles()  # logs every kernel variant compiled after start-up, with its specialization
    core = llm.engine
    vocab = llm.resolved.arch.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    ids = iter(range(10**9))

    def add() -> None:
        prompt = torch.randint(0, vocab, (args.input_len,), generator=generator).tolist()
        core.add_request(EngineCoreRequest(f"r{next(ids)}", prompt, params, max_tokens=3000))

    def timed_step() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(args.decodes):
        add()
    for _ in range(args.decodes * args.input_len // 2048 + 8):  # every prompt computed
        core.step()
    decode = [timed_step() for _ in range(args.repeats)]
    mixed = []
    for _ in range(args.repeats):
        add()
        mixed.append(timed_step())
        for _ in range(2):
            core.step()
    if args.async_scheduling:
        # As serving runs it: steps back to back, a new prompt every 4th step; how long the host
        # takes to launch each step (the runner's execute_model_async) and the allocator's counters.
        launch_times: list[tuple[bool, float]] = []
        launch = core.executor.execute_model_async

        def timed_launch(so):  # noqa: ANN001, ANN202
            started = time.perf_counter()
            pending = launch(so)
            mixed_step = any(n > 1 for n in so.num_scheduled_tokens.values())
            launch_times.append((mixed_step, time.perf_counter() - started))
            return pending

        core.executor.execute_model_async = timed_launch
        # Host time inside the piecewise graphs' eager attention calls.
        runner = core.runner
        attention_host = [0.0]
        if runner.piecewise is not None:
            backend = runner.piecewise.attn_backend
            forward = backend.forward

            def timed_forward(*a, **k):  # noqa: ANN002, ANN003, ANN202
                t = time.perf_counter()
                result = forward(*a, **k)
                attention_host[0] += time.perf_counter() - t
                return result

            backend.forward = timed_forward
        before = torch.cuda.memory_stats()
        started = time.perf_counter()
        for i in range(40):
            if i % 4 == 0:
                add()
            core.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        after = torch.cuda.memory_stats()
        core.executor.execute_model_async = launch
        for kind in (True, False):
            times = [t for m, t in launch_times if m == kind]
            if times:
                print(f"async: {'mixed' if kind else 'decode-only'} steps {len(times)}, host launch median "
                      f"{1000 * statistics.median(times):.2f} ms, max {1000 * max(times):.2f} ms")
        print(f"async: 40 steps in {1000 * wall:.1f} ms; host time in piecewise attention calls "
              f"{1000 * attention_host[0]:.1f} ms in all")
        if runner.piecewise is not None:
            del backend.forward  # the instance attribute: the class method again
        for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
            print(f"  allocator {key}: +{after.get(key, 0) - before.get(key, 0)}")
    print(f"{args.decodes} decodes: step median {1000 * statistics.median(decode):.2f} ms")
    print(f"{args.decodes} decodes + one {args.input_len}-token prefill: step median {1000 * statistics.median(mixed):.2f} ms")

    add()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        core.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)

    # The host's Python: cProfile over a few mixed steps.
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(3):
        add()
        torch.cuda.synchronize()
        profiler.enable()
        core.step()
        torch.cuda.synchronize()
        profiler.disable()
        core.step()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    done = compiles.drain()
    print(f"{len(done)} Triton compiles after start-up, {sum(c[2] for c in done):.2f} s: {sorted({c[0] for c in done})}")


if __name__ == "__main__":
    main()
