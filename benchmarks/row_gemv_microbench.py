"""Batch-1 decode matmuls of Llama-3.1-8B: cuBLAS against the row GEMV (kernels/triton/gemv.py).

The split-K Triton GEMV of gemv_microbench.py (dropped; BENCHMARKS.md keeps its figures) read
in-major weights ([in, out] row-major, as CausalLM used to store them for cuBLAS) and needed K
splits plus a reduction to fill the GPU.
With the weight out-major ([out, in], each output's row contiguous) one program streams a whole
row with wide loads and reduces in registers: N programs, one launch, no workspace. Earlier
versions of this file timed the same scheme in CUDA C compiled through NVRTC (commit b5a3534; no
better than Triton) and, from an uncommitted tree, a multi-row variant at 2-8 rows (slower than
cuBLAS from two rows on): BENCHMARKS.md has their figures.

Each shape is timed as one CUDA graph of 32 matmuls over 32 distinct weights (as a decode step
reads them; lm_head: 4 copies), us per matmul; o_proj and down add a residual (cuBLAS: `addmm_`,
beta = 1; the GEMV in place, as the deferred-norm decode path runs it, and into another buffer).
cuBLAS with the weight in-major and out-major, the row GEMV with its default config
(`row_gemv_config`) and the best few of a sweep. Then one decode step's projections (4 x 32
layers + lm_head) in one graph: cuBLAS in-major against the row GEMV's defaults.

    PYTHONPATH=src python3 benchmarks/row_gemv_microbench.py
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from tokenmill.bench.latency import copy_bandwidth
from tokenmill.bench.timing import graph_ms
from tokenmill.kernels.triton.gemv import row_gemv, row_gemv_config

SHAPES = {  # name: (out, in, adds a residual, copies)
    "qkv": (6144, 4096, False, 32),
    "o_proj": (4096, 4096, True, 32),
    "gate_up": (28672, 4096, False, 32),
    "down": (4096, 14336, True, 32),
    "lm_head": (128256, 4096, False, 4),
}
SWEEP = list(itertools.product((512, 1024, 2048), (4, 8), (1, 2, 3)))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul (fraction of copy bandwidth)")
    device = torch.device("cuda")
    for name, (n, k, adds, copies) in SHAPES.items():
        ideal_us = n * k * 2 / bandwidth * 1e6

        def report(label: str, us: float, name: str = name, ideal_us: float = ideal_us) -> None:
            print(f"  {name:8s} {us:8.2f} us ({ideal_us / us:.3f})  {label}", flush=True)

        w_out = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        residual = torch.randn(1, n, device=device, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        for layout in ("in-major", "out-major"):
            weights = w_out if layout == "out-major" else [w.t().contiguous().t() for w in w_out]
            if adds:
                calls = [lambda w=w, x=x, r=residual: r.addmm_(x, w.t()) for w in weights]
            else:
                calls = [lambda w=w, x=x: F.linear(x, w) for w in weights]
            report(f"cublas {layout}", graph_ms(calls) * 1000 / copies)
            del weights, calls
        default = row_gemv_config(n, k)
        variants = (
            {"": (None, y)} if not adds else {"in place": (residual, residual), "into y": (residual, y)}
        )
        for variant, (res, out) in variants.items():
            timed = {}
            for config in dict.fromkeys((default, *SWEEP)):
                calls = [
                    lambda w=w, c=config, x=x, r=res, o=out: row_gemv(x, w, residual=r, out=o, config=c)
                    for w in w_out
                ]
                timed[config] = graph_ms(calls) * 1000 / copies
            report(f"row_gemv {variant} default {default}", timed[default])
            for config in sorted(timed, key=timed.get)[:3]:
                report(f"row_gemv {variant} {config}", timed[config])
        expected = (x.float() @ w_out[0].float().t() + (residual.float() if adds else 0)).to(torch.bfloat16)
        got = row_gemv(x, w_out[0], residual=residual if adds else None)
        print(
            f"  {name:8s} max |row_gemv - float32 rounded once| = {(got.float() - expected.float()).abs().max():.2e}"
        )
        del w_out
        torch.cuda.empty_cache()

    print("one decode step's projections (4 x 32 layers + lm_head), one graph:")
    layers = [
        {
            name: torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
            for name, (n, k, _, c) in SHAPES.items()
            if c == 32
        }
        for _ in range(32)
    ]
    lm_head = torch.randn(128256, 4096, device=device, dtype=torch.bfloat16) / 64
    total_bytes = sum(w.nbytes for layer in layers for w in layer.values()) + lm_head.nbytes
    xs = {
        name: torch.randn(1, k, device=device, dtype=torch.bfloat16) for name, (_, k, _, _) in SHAPES.items()
    }
    residual = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    logits = torch.empty(1, 128256, device=device, dtype=torch.float32)
    for kind in ("cublas in-major", "row_gemv"):
        calls = []
        for layer in [*layers, {"lm_head": lm_head}]:
            for name, w in layer.items():
                x, adds = xs[name], SHAPES[name][2]
                if kind == "row_gemv":
                    if adds:
                        calls.append(lambda w=w, x=x: row_gemv(x, w, residual=residual, out=residual))
                    elif name == "lm_head":
                        calls.append(lambda w=w, x=x: row_gemv(x, w, out=logits))
                    else:
                        calls.append(lambda w=w, x=x: row_gemv(x, w))
                else:
                    wt = w.t().contiguous().t()
                    if adds:
                        calls.append(lambda wt=wt, x=x: residual.addmm_(x, wt.t()))
                    elif name == "lm_head":
                        calls.append(lambda wt=wt, x=x: logits.copy_(F.linear(x, wt)))
                    else:
                        calls.append(lambda wt=wt, x=x: F.linear(x, wt))
        ms = graph_ms(calls)
        print(f"  {kind}: {ms:.3f} ms ({total_bytes / (ms / 1000) / bandwidth:.3f} of copy)", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
