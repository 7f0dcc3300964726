"""CPU: wall time of greedy decoding with and without oneDNN-packed matmul weights, per batch size.

For each batch size, two fresh `LLM`s on the default model (--cpu-weight-packing on, then off)
generate 24 tokens for that many 16-token random prompts after one untimed warm-up call; the
matmul time is the self time of the matmul op in torch.profiler (aten::mm unpacked,
mkldnn::_linear_pointwise packed). Short prompts keep the decode steps, whose row count is the
batch size, most of the work.

    PYTHONPATH=src python benchmarks/cpu_weight_packing_ab.py --batch 1 8 32 64 [--threads 1]

(`--threads 1` is how `tokenmill serve` runs the engine on a 2-core machine.)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams

MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")


def run(batch: int, packing: bool) -> tuple[float, float]:
    llm = LLM(cpu_weight_packing=packing, max_model_len=512)
    generator = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 49152, (16,), generator=generator).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    matmul_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
    return wall, matmul_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    for batch in args.batch:
        (packed_wall, packed_mm), (plain_wall, plain_mm) = run(batch, True), run(batch, False)
        print(
            f"batch {batch:3d}: packed {packed_wall:6.2f} s (matmuls {packed_mm:5.2f} s)  "
            f"plain {plain_wall:6.2f} s (matmuls {plain_mm:5.2f} s)  speedup {plain_wall / packed_wall:4.2f}x"
        )


if __name__ == "__main__":
    main()
