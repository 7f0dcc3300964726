"""Time one-request prefills through the engine and list the CUDA kernels of one, to compare two
trees of the engine (run it with PYTHONPATH pointing at each).

    PYTHONPATH=src python benchmarks/prefill_profile.py --model benchmarks/configs/llama-3.1-8b

Each request has a fresh random prompt (no prefix-cache hit) and max_tokens=1, so a request is
one prefill step plus sampling. Prints the median wall time of a request, the host time of the
step's Python (profiler CPU total) and the kernels by total device time.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, load_format="dummy", max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    vocab = llm.resolved.arch.vocab_size

    def prompt() -> dict:
        return {"prompt_token_ids": torch.randint(0, vocab, (args.input_len,), generator=generator).tolist()}

    for _ in range(3):  # warm-up
        llm.generate(prompt(), params)
    times = []
    for _ in range(args.requests):
        p = prompt()
        torch.cuda.synchronize()
        started = time.perf_counter()
        llm.generate(p, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    print(f"prefill {args.input_len} tokens + 1 sampled: median {1000 * statistics.median(times):.2f} ms, "
          f"min {1000 * min(times):.2f} ms over {args.requests} requests")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.generate(prompt(), params)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    device_total = sum(e.device_time_total for e in kernels) / 3
    launches = sum(e.count for e in kernels) / 3
    print(f"per request: {launches:.0f} kernel launches, {device_total / 1000:.2f} ms of kernels")
    for e in kernels[: args.top]:
        print(f"  {e.count / 3:6.0f} x {e.key[:90]:90s} {e.device_time_total / 3000:8.3f} ms")


if __name__ == "__main__":
    main()
