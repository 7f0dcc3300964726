"""Batch-1 decode matmuls of Llama-3.1-8B: cuBLAS against row-per-warp GEMVs on out-major weights.

The split-K Triton GEMV of gemv_microbench.py read in-major weights ([in, out] row-major, as
CausalLM stores them for cuBLAS) and needed K splits plus a reduction to fill the GPU. With the
weight out-major ([out, in], each output's row contiguous) a GEMV needs no split: one warp (or a
few rows per program) streams whole rows with 16-byte loads and reduces in registers, one launch,
no workspace. Two such kernels here: Triton, and CUDA C compiled at run time through NVRTC
(`torch.cuda._compile_kernel`, which the CUDA builds of torch carry; no toolkit needed).

Each shape is timed as one CUDA graph of 32 matmuls over 32 distinct weights (as a decode step
reads them), us per matmul; o_proj and down add a residual (cuBLAS: `addmm_`, beta = 1), as the
deferred-norm decode path does. Then one decode step's worth of the four projections x 32 layers
in one graph, cuBLAS against the best GEMV per shape.

    PYTHONPATH=src python3 benchmarks/row_gemv_microbench.py
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemv_microbench import graph_ms  # benchmarks/ is on sys.path when run as a script

from tokenmill.bench.latency import copy_bandwidth

SHAPES = {  # name: (out, in, adds a residual)
    "qkv": (6144, 4096, False),
    "o_proj": (4096, 4096, True),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, True),
}
COPIES = 32


@triton.jit
def _row_gemv_kernel(
    x_ptr, w_ptr, res_ptr, y_ptr, N, K,
    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_RES:
        y += tl.load(res_ptr + rows).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def triton_row_gemv(x, w, res, y, block_n, block_k, warps, stages):
    n, k = w.shape
    _row_gemv_kernel[(n // block_n,)](
        x, w, res if res is not None else y, y, n, k,
        HAS_RES=res is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


# One warp computes ROWS outputs. Lane l reads 16 bytes (8 bf16) at chunk l, l + 32, ... of each
# row, UNROLL chunks per row in flight before any arithmetic; x's chunk is read once for all rows.
# bf16 -> fp32 is a shift (exact); fp32 -> bf16 rounds to nearest even (inputs are finite).
CUDA_SOURCE = r"""
#ifdef PLAIN_LOADS
#define LOAD_STREAMING(p) (*(p))
#else
#define LOAD_STREAMING(p) __ldcs(p)
#endif
extern "C" __global__ void __launch_bounds__(WARPS * 32)
row_gemv(const uint4* __restrict__ x, const uint4* __restrict__ w,
         const unsigned short* __restrict__ res, unsigned short* __restrict__ y, int n, int k8) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= n) return;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  const uint4* wrow = w + (long long)row0 * k8;
  for (int c0 = lane; c0 < k8; c0 += 32 * UNROLL) {
    uint4 wv[UNROLL][ROWS];
    uint4 xv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (c < k8) {
        xv[u] = x[c];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[u][r] = LOAD_STREAMING(wrow + (long long)r * k8 + c);
      } else {
        xv[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) wv[u][r] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int xs[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const unsigned int ws[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[r] = fmaf(__uint_as_float(ws[j] << 16), __uint_as_float(xs[j] << 16), acc[r]);
          acc[r] = fmaf(__uint_as_float(ws[j] & 0xffff0000u), __uint_as_float(xs[j] & 0xffff0000u), acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
  if (lane < ROWS) {
    float v = acc[0];
#pragma unroll
    for (int r = 1; r < ROWS; ++r) if (lane == r) v = acc[r];
    if (HAS_RES) v += __uint_as_float(((unsigned int)res[row0 + lane]) << 16);
    unsigned int bits = __float_as_uint(v);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    y[row0 + lane] = (unsigned short)(bits >> 16);
  }
}
"""

_cuda_kernels: dict[tuple[int, int, int, bool], object] = {}


def cuda_row_gemv(x, w, res, y, rows, warps, unroll):
    n, k = w.shape
    key = (rows, warps, unroll, res is not None)
    kernel = _cuda_kernels.get(key)
    if kernel is None:
        source = (
            f"#define ROWS {rows}\n#define WARPS {warps}\n#define UNROLL {unroll}\n"
            f"#define HAS_RES {int(res is not None)}\n" + CUDA_SOURCE
        )
        try:
            kernel = torch.cuda._compile_kernel(source, "row_gemv")
        except Exception as exc:
            print(f"  NVRTC: {type(exc).__name__}: {str(exc)[:300]}; retrying with plain loads")
            kernel = torch.cuda._compile_kernel("#define PLAIN_LOADS\n" + source, "row_gemv")
        _cuda_kernels[key] = kernel
    grid = (triton.cdiv(n, rows * warps), 1, 1)
    kernel(grid=grid, block=(warps * 32, 1, 1), args=[x, w, res if res is not None else y, y, n, k // 8])


def main() -> None:
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)} torch {torch.__version__} triton {triton.__version__}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul (fraction of copy)")
    device = torch.device("cuda")
    has_nvrtc = hasattr(torch.cuda, "_compile_kernel")
    best: dict[str, tuple[float, str, object]] = {}
    cublas_us: dict[str, float] = {}
    for name, (n, k, adds) in SHAPES.items():
        ideal_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=device, dtype=torch.bfloat16) if adds else None
        w_out = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)]
        w_in = [w.t().contiguous().t() for w in w_out[:1]] + [
            torch.randn(k, n, device=device, dtype=torch.bfloat16).t() for _ in range(COPIES - 1)
        ]
        y = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        ref = (
            (F.linear(x.float(), w_out[0].float()) + (res.float() if adds else 0)).to(torch.bfloat16).float()
        )

        def report(label: str, us: float, name: str = name, ideal_us: float = ideal_us) -> None:
            print(f"  {name:8s} {us:7.2f} us ({ideal_us / us:.3f})  {label}", flush=True)

        for layout, weights in (("in-major", w_in), ("out-major", w_out)):
            if adds:
                r2 = res.clone()
                fns = [lambda w=w, r2=r2, x=x: r2.addmm_(x, w.t()) for w in weights]
            else:
                fns = [lambda w=w, x=x: F.linear(x, w) for w in weights]
            us = graph_ms(fns) * 1000 / COPIES
            report(f"cublas {layout}", us)
            if layout == "in-major":
                cublas_us[name] = us
        candidates: list[tuple[str, object]] = []
        for block_n, block_k, warps, stages in itertools.product(
            (1, 2, 4, 8), (512, 1024, 2048), (4, 8), (1, 2)
        ):
            if block_n * block_k > 4096 or k % block_k or n % block_n:
                continue
            candidates.append(
                (
                    f"triton n{block_n} k{block_k} w{warps} s{stages}",
                    lambda w, x=x, res=res, y=y, bn=block_n, bk=block_k, wa=warps, st=stages: triton_row_gemv(
                        x, w, res, y, bn, bk, wa, st
                    ),
                )
            )
        if has_nvrtc:
            for rows, warps, unroll in itertools.product((1, 2, 4), (2, 4, 8), (1, 2, 4, 8)):
                if rows * unroll > 16:
                    continue
                candidates.append(
                    (
                        f"cuda rows{rows} warps{warps} unroll{unroll}",
                        lambda w, x=x, res=res, y=y, r=rows, wa=warps, u=unroll: cuda_row_gemv(
                            x, w, res, y, r, wa, u
                        ),
                    )
                )
        results = []
        for label, fn in candidates:
            try:
                fn(w_out[0])
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    print(f"  {name} {label}: relative error {err:.2e}, skipped")
                    continue
                us = graph_ms([lambda w=w, fn=fn: fn(w) for w in w_out]) * 1000 / COPIES
            except Exception as exc:  # a config the compiler rejects: say so, go on with the sweep
                print(f"  {name} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            results.append((us, label, fn))
        results.sort(key=lambda r: r[0])
        for us, label, _ in results[:8]:
            report(label, us)
        for kind in ("triton", "cuda"):
            top = [r for r in results if r[1].startswith(kind)]
            if top:
                report(f"best {kind}: {top[0][1]}", top[0][0])
        if results:
            best[name] = results[0]
        del w_out, w_in
        torch.cuda.empty_cache()

    # One decode step's projections (32 layers), each shape's weights distinct per layer.
    print("one step of the four projections x 32 layers, one graph:")
    layers = []
    for _ in range(32):
        layers.append(
            {
                name: torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
                for name, (n, k, _) in SHAPES.items()
            }
        )
    total_bytes = sum(n * k * 2 for n, k, _ in SHAPES.values()) * 32
    x_of = {
        name: torch.randn(1, k, device=device, dtype=torch.bfloat16) for name, (n, k, _) in SHAPES.items()
    }
    res = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    for kind in ("cublas in-major", "gemv"):
        calls = []
        for layer in layers:
            for name, (_n, _k, adds) in SHAPES.items():
                w = layer[name]
                if kind.startswith("cublas"):
                    wt = w.t().contiguous().t()
                    layer[name + "_in"] = wt
                    if adds:
                        calls.append(lambda wt=wt, x=x_of[name]: res.addmm_(x, wt.t()))
                    else:
                        calls.append(lambda wt=wt, x=x_of[name]: F.linear(x, wt))
                elif name in best:
                    fn = best[name][2]
                    calls.append(lambda w=w, fn=fn: fn(w))
        ms = graph_ms(calls)
        print(f"  {kind}: {ms:.3f} ms ({total_bytes / (ms / 1000) / bandwidth:.3f} of copy)")
        for layer in layers:
            for name in SHAPES:
                layer.pop(name + "_in", None)
    print(
        "best per shape:",
        {name: (round(b[0], 2), b[1], round(cublas_us[name], 2)) for name, b in best.items()},
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
