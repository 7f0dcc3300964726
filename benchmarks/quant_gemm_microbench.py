"""The batched quantized CPU matmul (kernels/cpu/csrc/cpu_quant_gemm.cpp) against oneDNN's
float32 linear over the same weights prepacked, as a decode step meets them, and, where the build
has AVX-512 VNNI, the 16-bit-activation integer kernel (csrc/cpu_quant_gemm_vnni.cpp).

`--layers` different random Q4_1 matrices of one shape (default 30 of 1536 x 576, SmolLM2-135M's
gate/up shape; their float32 copies, 106 MB, do not fit in L3, as the model's 425 MB do not) are
multiplied in turn by M float32 rows; ms per matmul, best of `--reps` passes, torch on 1 thread
(the CPU engine's default). Whichever path the build has (AVX-512 or AVX2+FMA) runs.

    PYTHONPATH=src python3 benchmarks/quant_gemm_microbench.py --rows 2,4,8,16,32,64,512
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def random_q4_1_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q4_1 block rows [n, k / 32 * 20]: float16 d and m, random quants."""
    rows = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    rows[..., :4] = (rng.standard_normal((n, k // 32, 2)) * 0.05).astype(np.float16).view(np.uint8).reshape(n, -1, 4)
    return rows.reshape(n, -1)


def best_ms(fn, reps: int, per: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times) / per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2,4,8,16,32,64", help="comma-separated activation row counts")
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenmill.kernels.cpu.build import load_cpu_kernels
    from tokenmill.kernels.cpu.quant_gemv import (
        QuantizedBlocks,
        gemm_available,
        gemm_vnni16_available,
        quantized_linear,
        split_rows,
    )
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    load_cpu_kernels()
    if not gemm_available():
        raise SystemExit("this build has no batched quantized kernel (needs AVX-512 or AVX2+FMA)")
    torch.set_num_threads(args.threads)
    n, k = args.out_features, args.in_features
    rng = np.random.default_rng(0)
    rows = [random_q4_1_rows(rng, n, k) for _ in range(args.layers)]
    packed = [
        torch.ops.mkldnn._reorder_linear_weight(
            torch.from_numpy(dequantize(r, GGMLQuantizationType.Q4_1).astype(np.float32)), 64
        )
        for r in rows
    ]
    blocks = [QuantizedBlocks(torch.from_numpy(split_rows(r, 0)), 0, n) for r in rows]
    vnni = [torch.from_numpy(vnni_rows(r, 0)) for r in rows] if gemm_vnni16_available() else []
    print(f"{args.layers} x [{n}, {k}] Q4_1, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    for m in (int(value) for value in args.rows.split(",")):
        x = torch.randn(m, k)
        onednn = best_ms(
            lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
            args.reps, args.layers,
        )  # fmt: skip
        quant = best_ms(lambda x=x: [quantized_linear(x, b, None) for b in blocks], args.reps, args.layers)
        line = f"rows {m:4d}: oneDNN float32 {onednn:7.3f} ms, quant_gemm {quant:7.3f} ms, ratio {onednn / quant:5.2f}"
        if vnni:
            vnni16 = best_ms(
                lambda x=x: [torch.ops.tokenmill_cpu.quant_linear_vnni16(x, v, 0) for v in vnni], args.reps, args.layers
            )
            line += f", vnni16 {vnni16:7.3f} ms (vs quant_gemm {quant / vnni16:5.2f}x, vs oneDNN {onednn / vnni16:5.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
