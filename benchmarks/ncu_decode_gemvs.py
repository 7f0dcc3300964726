"""Launch each one-row decode GEMV of Llama-3.1-8B's qkv, gate_up and down three times, for Nsight
Compute to profile: INT4 W4A16 (int4_linear, group 128), the bf16 row GEMV (gemv.py) and the FP8
W8A16 GEMV (fp8_gemv.py, its default tiles). Random weights; nothing is timed here.

    ncu --clock-control none -k regex:"int4_matmul|row_gemv|fp8_gemv" --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python3 benchmarks/ncu_decode_gemvs.py
(benchmarks/results/ncu-decode-gemvs-h200-1c4cce9.txt.gz is that output on an H200, from the same
launches at `1c4cce9`, before the FP8 GEMV could split K.)
"""

from __future__ import annotations

import argparse

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # name: (N, K)
KINDS = ("int4", "bf16", "fp8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--launches", type=int, default=3, help="launches of each GEMV")
    args = parser.parse_args()

    import torch

    from tokenmill.kernels.triton.fp8_linear import fp8_linear, prepare_fp8_weights
    from tokenmill.kernels.triton.gemv import row_gemv
    from tokenmill.kernels.triton.int4_linear import int4_linear, prepare_int4_weights

    torch.manual_seed(0)
    for n, k in SHAPES.values():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        calls = []
        if "int4" in args.kinds:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
            scales = (torch.rand(n, k // 128, device="cuda") / 100).to(torch.bfloat16)
            zeros = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device="cuda")
            calls.append(lambda w=prepare_int4_weights(q, scales, zeros, 128), x=x: int4_linear(x, w))
        if "bf16" in args.kinds:
            calls.append(lambda w=torch.randn(n, k, device="cuda", dtype=torch.bfloat16), x=x: row_gemv(x, w))
        if "fp8" in args.kinds:
            w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            calls.append(
                lambda w=prepare_fp8_weights(w8, torch.rand(n, device="cuda"), None), x=x: fp8_linear(x, w)
            )
        for call in calls:
            for _ in range(args.launches):
                call()
        torch.cuda.synchronize()
    print(f"launched {args.launches} x {', '.join(args.kinds)} at {', '.join(SHAPES)}")


if __name__ == "__main__":
    main()
