"""Llama-3.1-8B's linear layers: the 16-bit CUDA path against INT4 W4A16 (kernels/triton/int4_linear.py).

The bf16 side is `CudaLinearMethod.apply` as the engine runs it: the row GEMV for one row, the skinny
GEMM for 2-8, cuBLAS beyond. The INT4 side is `int4_linear` with group-128 weights (AWQ / GPTQ's
usual) and its default tiles (`int4_config`); `--sweep` also times candidate tiles at some row
counts and reports the best (how the defaults were chosen). Each figure is one CUDA graph of calls
over distinct weight copies (enough to overflow L2, as a decode step's layers do), us per matmul,
and the bytes the call must move (weights, scales, x, y) per second. Every timed INT4 config is
first checked against F.linear on the dequantized weights.

    PYTHONPATH=src python3 benchmarks/int4_linear_microbench.py [--sweep] [--name FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types

import torch
import triton

from tokenmill.bench.latency import copy_bandwidth
from tokenmill.bench.results import write_result
from tokenmill.bench.timing import graph_ms
from tokenmill.kernels.triton.int4_configs import (
    MAX_SPLIT_K_ROWS,
    Int4Config,
    block_m_for,
    device_sms,
    int4_config,
)
from tokenmill.kernels.triton.int4_linear import int4_linear, prepare_int4_weights
from tokenmill.model.layers.cuda_linear import CudaLinearMethod

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192)
SWEEP_ROWS = (1, 16, 32, 64, 128, 512)
GROUP_SIZE = 128
L2_BYTES_TO_OVERFLOW = 200 * 2**20


def decode_candidates(m: int) -> list[Int4Config]:
    """32 weight rows per warp (fewer leave the scale loads outside Triton's pipeline) or 16 on
    more warps, weights as the dot's left or right operand, 2-6 stages, K split 1-8 ways."""
    block_m = block_m_for(m)
    if block_m == 64:
        tiles = [(128, 4, 4, True, True), (128, 4, 3, False, True), (64, 2, 4, True, True)]
        splits = (1, 2, 4)
    else:
        tiles = [
            (64, 2, 4, True, True),
            (64, 2, 6, True, True),
            (64, 2, 2, True, True),
            (64, 4, 4, True, True),
            (32, 1, 4, True, True),
            (128, 4, 4, True, True),
            (128, 4, 4, True, False),
            (128, 8, 3, True, True),
        ]
        splits = (1, 2, 4, 8)
    configs = [
        Int4Config(block_m, n, s, w, st, scale_after, w_left)
        for n, w, st, scale_after, w_left in tiles
        for s in splits
    ]
    # Zero points through sum(x) (ZERO_BY_XSUM) on the scale-after, weights-left tiles.
    return configs + [dataclasses.replace(c, zero_by_xsum=True) for c in configs if c.scale_after and c.w_left]


PREFILL_CANDIDATES = [
    Int4Config(128, 128, dequantize=True),
    Int4Config(128, 128, 1, 8, 2, False),
    Int4Config(64, 128, 1, 4, 3, False),
    Int4Config(64, 128, 1, 4, 4, True),
]


def random_int4_weights(n: int, k: int, seed: int):
    """(Int4Weights, float32 dequantized W) of random group-128 asymmetric weights (AWQ-like)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = k // GROUP_SIZE
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device="cuda")
    scales = ((torch.rand(n, groups, generator=gen, device="cuda") + 0.5) / (4 * k**0.5)).half()
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8, device="cuda")
    w = prepare_int4_weights(q, scales, zeros, GROUP_SIZE)
    group = torch.arange(k, device="cuda") // GROUP_SIZE
    return w, (q.float() - zeros.float()[:, group]) * scales.float()[:, group]


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", action="store_true", help=f"also time candidate tiles at rows {SWEEP_ROWS}"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="result file name (default: benchmark name + time)")
    args = parser.parse_args()

    bandwidth = copy_bandwidth("cuda")
    device = torch.device("cuda")
    sms = device_sms(device)
    print(
        f"{torch.cuda.get_device_name(0)}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); us per matmul, GB/s of bytes moved")
    bf16_method = CudaLinearMethod()
    results, sweeps = [], []
    for name in args.shapes:
        n, k = SHAPES[name]
        int4_bytes = n * k // 2
        copies = max(2, min(32, math.ceil(L2_BYTES_TO_OVERFLOW / int4_bytes)))
        packed = [random_int4_weights(n, k, seed) for seed in range(copies)]
        dense_first = packed[0][1]
        weights = [w for w, _ in packed]
        del packed
        layers = [
            types.SimpleNamespace(weight=(torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16))
            for _ in range(copies)
        ]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            expected = x.float() @ dense_first.t()
            io_bytes = m * k * 2 + m * n * 2
            bf16_calls = [lambda layer=layer, x=x: bf16_method.apply(layer, x) for layer in layers]
            bf16_us = graph_ms(bf16_calls) * 1e3 / copies
            cfg = int4_config(m, n, weights[0].k_padded, sms)
            err = relative_error(int4_linear(x, weights[0]), expected)
            int4_us = graph_ms([lambda w=w, x=x: int4_linear(x, w) for w in weights]) * 1e3 / copies
            int4_moved = weights[0].nbytes() + io_bytes
            row = {
                "shape": name, "n": n, "k": k, "m": m,
                "bf16_us": bf16_us, "int4_us": int4_us, "speedup": bf16_us / int4_us,
                "bf16_gbps": (n * k * 2 + io_bytes) / bf16_us / 1e3, "int4_gbps": int4_moved / int4_us / 1e3,
                "int4_fraction_of_copy_bw": int4_moved / (int4_us * 1e-6) / bandwidth,
                "int4_config": repr(cfg), "int4_rel_error": err,
            }  # fmt: skip
            results.append(row)
            print(
                f"  {name:8s} m={m:4d}  bf16 {bf16_us:8.2f} us {row['bf16_gbps']:7.0f} GB/s   "
                f"int4 {int4_us:8.2f} us "
                f"{row['int4_gbps']:7.0f} GB/s   x{row['speedup']:.2f}  err {err:.1e}  {cfg}",
                flush=True,
            )
            if args.sweep and m in SWEEP_ROWS:
                sweeps.append(sweep(name, n, k, m, x, expected, weights, copies, io_bytes))
        del weights, layers, dense_first
        torch.cuda.empty_cache()

    summary = {}
    for m in args.rows:
        picked = [r for r in results if r["m"] == m]
        if {r["shape"] for r in picked} == set(SHAPES):  # a decoder layer: each projection once
            bf16 = sum(r["bf16_us"] for r in picked)
            int4 = sum(r["int4_us"] for r in picked)
            summary[str(m)] = {"bf16_us": bf16, "int4_us": int4, "speedup": bf16 / int4}
            print(
                f"  layer (qkv + o + gate_up + down) m={m:4d}: bf16 {bf16:8.2f} us  int4 {int4:8.2f} us  "
                f"x{bf16 / int4:.2f}"
            )
    path = write_result(
        "int4-linear-microbench",
        {"shapes": {s: SHAPES[s] for s in args.shapes}, "rows": args.rows, "group_size": GROUP_SIZE,
         "sweep": args.sweep, "sms": sms, "copy_bandwidth_bytes_per_s": bandwidth},
        {"rows": results, "layer": summary, "sweeps": sweeps},
        out_dir=args.out_dir,
        name=args.name,
    )  # fmt: skip
    print(f"wrote {path}")


def sweep(name, n, k, m, x, expected, weights, copies, io_bytes) -> dict:
    """Time each candidate config (checked first); print and return the best few."""
    candidates = decode_candidates(m) if m <= MAX_SPLIT_K_ROWS else PREFILL_CANDIDATES
    timed = {}
    for cfg in candidates:
        try:
            err = relative_error(int4_linear(x, weights[0], config=cfg), expected)
            if err > 1e-2:
                print(f"    sweep {name} m={m} {cfg}: relative error {err:.1e}, skipped")
                continue
            calls = [lambda w=w, c=cfg: int4_linear(x, w, config=c) for w in weights]
            timed[cfg] = graph_ms(calls) * 1e3 / copies
        except Exception as exc:  # a config the compiler rejects (shared memory): report it, go on
            print(f"    sweep {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
    ranked = sorted(timed, key=timed.get)
    moved = weights[0].nbytes() + io_bytes
    for cfg in ranked[:4]:
        gbps = moved / timed[cfg] / 1e3
        print(f"    sweep {name} m={m}: {timed[cfg]:8.2f} us {gbps:7.0f} GB/s  {cfg}", flush=True)
    return {"shape": name, "m": m, "timed": [{"config": repr(c), "us": timed[c]} for c in ranked]}


if __name__ == "__main__":
    main()
