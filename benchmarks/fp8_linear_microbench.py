"""FP8 weight matmuls at Llama-3.1-8B's shapes: today's 16-bit path against each FP8 path, by rows.

For each projection (qkv, o_proj and down with the residual add the decode step gives them,
gate_up, lm_head) and M rows, us per matmul and achieved GB/s (weights + scales + activations +
outputs over the time) of:
- bf16: CudaLinearMethod's dispatch (row GEMV at 1 row, skinny GEMM at 2-8, cuBLAS beyond);
- each FP8 path of kernels/triton/fp8_linear.py where it applies: tc16 (W8A16 on tensor cores, K
  split, per-channel weights, 1-4 rows), gemv (W8A16, 1-4 rows),
  skinny16 (W8A16 tensor cores, up to 64), skinny8 (W8A8, up to 64), scaled_mm (per-channel
  W8A8 through cuBLASLt) and gemm (Triton W8A8), quantization launches included;
- which path fp8_linear's dispatch takes.
Per-channel and 128x128-block weights. Timed as one CUDA graph of matmuls over distinct weight
copies (at least 256 MiB of FP8 weights per graph, so L2 holds none of them between calls), us
per matmul, the median of 5 rounds of 20 replays. Then each path's measured error on copy 0 as the
dot-product part of the GPU tests' bound, and one decode step's projections at 1 and 8 rows
(32 layers + lm_head) summed from the table: bf16 against FP8.

With --sweep, also the kernels' tile configs at a few row counts, best first.

    PYTHONPATH=src python3 benchmarks/fp8_linear_microbench.py [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from types import SimpleNamespace

import torch
import triton

from tokenmill.bench.latency import copy_bandwidth
from tokenmill.bench.results import write_result
from tokenmill.bench.timing import graph_replay_ms
from tokenmill.kernels.triton import fp8_linear as fp8
from tokenmill.kernels.triton.fp8_gemm import fp8_gemm
from tokenmill.kernels.triton.fp8_gemv import fp8_gemv
from tokenmill.kernels.triton.fp8_quant import quantize_per_token, quantize_per_token_group
from tokenmill.kernels.triton.fp8_skinny import fp8_skinny
from tokenmill.kernels.triton.fp8_tc_gemv import fp8_tc_gemv
from tokenmill.model.layers.cuda_linear import CudaLinearMethod

SHAPES = {  # name: (out N, in K, adds the residual in the decode step)
    "qkv": (6144, 4096, False),
    "o_proj": (4096, 4096, True),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, True),
    "lm_head": (128256, 4096, False),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MAX_ROWS = {"tc16": 4, "gemv": 4, "skinny16": 16, "skinny8": 64, "scaled_mm": None, "gemm": None}
ACCURACY_ROWS = (1, 16, 64, 512)
BLOCK = fp8.SCALE_BLOCK

GEMV_SWEEP = {  # (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K])
    "channel": [(2, 1024, 4, 1), (2, 1024, 4, 2), (2, 1024, 4, 3), (4, 1024, 4, 1), (4, 1024, 4, 2), (8, 512, 4, 1),
                (8, 512, 4, 2), (8, 512, 8, 1), (16, 256, 4, 1), (16, 256, 4, 2),
                # whole rows per program, as gemv.py's 16-bit row GEMV reads them (added for the H200)
                (1, 4096, 4, 1), (1, 2048, 4, 1), (2, 2048, 8, 1), (4, 1024, 8, 1), (4, 2048, 8, 1), (8, 1024, 8, 1),
                (16, 512, 8, 1), (8, 512, 8, 2),
                # K split among programs: wider tiles (x reloaded for more weight rows), programs enough
                (8, 512, 4, 1, 2), (8, 512, 4, 1, 4), (8, 512, 8, 1, 8), (16, 256, 4, 1, 2), (16, 256, 4, 1, 4),
                (16, 512, 4, 1, 2), (16, 512, 4, 1, 4), (16, 512, 8, 1, 4), (16, 512, 8, 1, 8), (32, 256, 4, 1, 4),
                (32, 256, 8, 1, 8), (8, 1024, 8, 1, 4), (4, 1024, 4, 1, 4)],
    "block": [(4, 1024, 4, 1), (8, 512, 4, 1), (8, 512, 4, 2), (8, 512, 8, 1), (8, 1024, 8, 1), (16, 256, 4, 1),
              (16, 512, 8, 1), (32, 256, 8, 1)],
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): per-channel weights only. Each warp converts
# the whole x tile for its dot, so more weight rows a warp cost fewer instructions a weight (local
# sm_90 SASS, benchmarks/sass_loop_mix.py: 0.085 a weight at 64x128 / 2 warps, 0.062 at 128x64,
# 0.047 at 256x64; the CUDA-core GEMV 0.10-0.125), at fewer programs: hence the splits.
TC16_SWEEP = [
    (64, 128, 2, s, k) for s in (3, 4) for k in (1, 2, 4, 8)
] + [(128, 128, 4, 4, k) for k in (1, 2, 4, 8)] + [(64, 256, 2, 3, k) for k in (2, 4)] + [(32, 128, 1, 4, k) for k in (2, 4, 8)] + [
    (128, 64, 2, 4, k) for k in (1, 2, 4, 8)
] + [(256, 64, 2, 4, k) for k in (1, 2, 4, 8)]
SKINNY_SWEEP = {
    "channel": [(32, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
                (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3)],
    "block": [(32, 128, 4, 4), (32, 64, 4, 6), (64, 64, 4, 8), (64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4),
              (128, 128, 8, 3)],
}  # fmt: skip
GEMM_SWEEP = {
    "channel": [(64, 128, 128, 4, 4, 8), (64, 128, 128, 4, 5, 8), (128, 128, 128, 8, 3, 8), (128, 128, 128, 4, 4, 8),
                (128, 256, 128, 8, 3, 8), (64, 256, 128, 8, 4, 8), (128, 64, 128, 4, 4, 8)],
    "block": [(64, 128, 128, 4, 4, 8), (64, 128, 128, 4, 5, 8), (128, 128, 128, 8, 3, 8), (128, 128, 128, 4, 4, 8),
              (128, 64, 128, 4, 4, 8)],
}  # fmt: skip
SWEEP_ROWS = {"tc16": (1, 2), "gemv": (1, 2), "skinny16": (1, 16, 32, 64), "skinny8": (16, 32, 64), "gemm": (64, 128, 512)}


def graph_ms(calls) -> float:
    """ms per replay of one CUDA graph of `calls`: the median of 5 rounds of 20 replays. (The first
    H100 runs timed one round of 10, as the other matmul microbenchmarks do: for gate_up and lm_head
    the table then read up to 15 % above the sweep's figure for the same kernel config.)"""

    def run_all() -> None:
        for call in calls:
            call()

    return graph_replay_ms(run_all, reps=20, rounds=5)


def copies_for(n: int, k: int) -> int:
    return max(2, min(16, math.ceil(256 * 2**20 / (n * k))))


def moved_bytes(n: int, k: int, m: int, weight_bytes: int, adds: bool, scale_count: int) -> int:
    return n * k * weight_bytes + 4 * scale_count + m * k * 2 + m * n * 2 * (2 if adds else 1)


def random_fp8(n: int, k: int, block, gen: torch.Generator) -> fp8.Fp8Weights:
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // BLOCK[0]), -(-k // BLOCK[1]))
    return fp8.prepare_fp8_weights(weight, (torch.rand(shape, device="cuda", generator=gen) + 0.5) * 2e-4, block)


def dequantized(w: fp8.Fp8Weights) -> torch.Tensor:
    if w.block is None:
        return w.weight.double() * w.scale.double()[:, None]
    n, k = w.weight.shape
    full = w.scale.double().repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    return w.weight.double() * full


def quantized_activations(x: torch.Tensor, block) -> torch.Tensor:
    """x as the W8A8 paths see it (the same formula as fp8_quant.py), float64."""
    m, k = x.shape
    g = k if block is None else BLOCK[1]
    kb = -(-k // g)
    padded = torch.zeros(m, kb * g, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, g)
    absmax = groups.abs().amax(dim=2).clamp(min=1e-12)
    scale = absmax / torch.full_like(absmax, 448.0)  # tensor / tensor: an IEEE division, as the kernel's
    q = (groups / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale[:, :, None]
    return q.view(m, kb * g)[:, :k].double()


def dot_error(y: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor, residual64: torch.Tensor | None) -> float:
    """max over outputs of (|y - exact| - half an ulp of |exact|) / sum_k |x_k w_k|: the dot_rel the
    GPU tests' bound needs for this product."""
    exact = x64 @ w64.t() + (0 if residual64 is None else residual64)
    magnitude = x64.abs() @ w64.abs().t()
    half_ulp = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-24
    excess = ((y.double() - exact).abs() - half_ulp * exact.abs()).clamp(min=0)
    return (excess / magnitude.clamp(min=1e-300)).max().item()


def run_path(path: str, x, w, residual):
    return fp8.fp8_linear(x, w, residual=residual, path=path)


def applies(path: str, m: int, block) -> bool:
    limit = MAX_ROWS[path]
    return (limit is None or m <= limit) and (path not in ("scaled_mm", "tc16") or block is None)


def sweep_calls(kind: str, config, weights, x, block, residual):
    if kind == "tc16":
        return [
            lambda w=w: fp8_tc_gemv(x, w.weight, w.scale, w.tile_counters, residual=residual, config=config)
            for w in weights
        ]
    if kind == "gemv":
        return [
            lambda w=w: fp8_gemv(x, w.weight, w.scale, block, residual=residual, config=config, tile_counters=w.tile_counters)
            for w in weights
        ]
    if kind == "skinny16":
        return [lambda w=w: fp8_skinny(x, None, w.weight, w.scale, block, config=config) for w in weights]
    quant = quantize_per_token if block is None else quantize_per_token_group
    fn = fp8_skinny if kind == "skinny8" else fp8_gemm

    def call(w):
        xq, xs = quant(x)
        return fn(xq, xs, w.weight, w.scale, block, out_dtype=torch.bfloat16, config=config)

    return [lambda w=w: call(w) for w in weights]


def sweep(name, n, k, mode, block, weights, gen, kinds) -> list[dict]:
    rows_out = []
    if mode == "block":
        kinds = [kind for kind in kinds if kind != "tc16"]
    configs = {"tc16": TC16_SWEEP, "gemv": GEMV_SWEEP[mode], "skinny16": SKINNY_SWEEP[mode], "skinny8": SKINNY_SWEEP[mode],
               "gemm": GEMM_SWEEP[mode]}  # fmt: skip
    for kind, rows in SWEEP_ROWS.items():
        if kind not in kinds:
            continue
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            timed = {}
            for config in configs[kind]:
                if kind == "gemv" and config[0] * config[1] * m > 128 * 32 * config[2]:
                    continue  # more than 128 float32 accumulators a thread
                try:
                    calls = sweep_calls(kind, config, weights, x, block, residual)
                    timed[config] = graph_ms(calls) * 1000 / len(calls)
                except Exception as exc:  # a config the compiler rejects (shared memory): report, go on
                    print(f"    sweep {name} {mode} {kind} M={m} {config}: {type(exc).__name__}: {str(exc)[:100]}")
            best = sorted(timed, key=timed.get)
            cells = "  ".join(f"{c} {timed[c]:.2f}" for c in best[:3])
            print(f"    sweep {name:8s} {mode:7s} {kind:8s} M={m:<3d} best: {cells}", flush=True)
            rows_out.append(
                {"shape": name, "mode": mode, "kind": kind, "rows": m, "us": {str(c): timed[c] for c in best}}
            )
    if SHAPES[name][2] and "gemv" in kinds:  # in place into the residual, against a new tensor, at one row
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        for label, out in (("in place", residual), ("new tensor", None)):
            calls = [
                lambda w=w, o=out: fp8_gemv(
                    x, w.weight, w.scale, block, residual=residual, out=o, tile_counters=w.tile_counters
                )
                for w in weights
            ]
            us = graph_ms(calls) * 1000 / len(calls)
            print(f"    sweep {name:8s} {mode:7s} gemv residual {label}: {us:.2f} us")
            rows_out.append({"shape": name, "mode": mode, "kind": f"gemv residual {label}", "rows": 1, "us": us})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="projections to run")
    parser.add_argument(
        "--sweep", default="", help=f"also sweep the tile configs of these kernels (comma-separated: {','.join(SWEEP_ROWS)})"
    )
    parser.add_argument("--modes", default="channel,block", help="FP8 weight scale layouts to run (channel, block)")
    parser.add_argument("--result-dir", default="benchmarks/results", help="directory of the result JSON")
    parser.add_argument("--result-name", default=None, help="file name of the result JSON")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul, GB/s achieved; dispatch {fp8.DISPATCH}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, accuracy, sweeps = [], [], []
    errors: dict[str, str] = {}
    bf16_method = CudaLinearMethod()
    for name in args.shapes.split(","):
        n, k, adds = SHAPES[name]
        copies = copies_for(n, k)
        layers = [
            SimpleNamespace(weight=torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5)
            for _ in range(copies)
        ]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen) if adds else None
            calls = [lambda la=la, x=x, r=residual: bf16_method.apply(la, x, residual=r) for la in layers]
            us = graph_ms(calls) * 1000 / copies
            gbs = moved_bytes(n, k, m, 2, adds, 0) / us / 1e3
            results.append({"shape": name, "mode": "bf16", "path": "bf16", "rows": m, "us": us, "GBps": gbs})
        del layers
        torch.cuda.empty_cache()
        for mode, block in (("channel", None), ("block", BLOCK)):
            if mode not in args.modes.split(","):
                continue
            weights = [random_fp8(n, k, block, gen) for _ in range(copies)]
            failed: dict[str, str] = {}
            scale_count = weights[0].scale.numel()
            w64 = dequantized(weights[0])
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen) if adds else None
                chosen = fp8.choose_path(x, weights[0])
                bf16_us = next(r["us"] for r in results if r["shape"] == name and r["mode"] == "bf16" and r["rows"] == m)
                cells = []
                for path in fp8.PATHS:
                    if not applies(path, m, block) or path in failed:
                        continue
                    try:
                        run_path(path, x, weights[0], None if residual is None else residual.clone())
                    except Exception as exc:  # a path this torch / GPU lacks: report it once, go on
                        failed[path] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        print(f"  {name} {mode} {path}: {failed[path]}")
                        continue
                    calls = [lambda w=w, p=path, x=x, r=residual: run_path(p, x, w, r) for w in weights]
                    us = graph_ms(calls) * 1000 / copies
                    gbs = moved_bytes(n, k, m, 1, adds, scale_count) / us / 1e3
                    results.append(
                        {"shape": name, "mode": mode, "path": path, "rows": m, "us": us, "GBps": gbs,
                         "chosen": path == chosen, "speedup_vs_bf16": bf16_us / us}
                    )  # fmt: skip
                    cells.append(f"{path}{'*' if path == chosen else ''} {us:7.2f} ({gbs:5.0f})")
                    if m in ACCURACY_ROWS:
                        res = None if residual is None else residual.clone()
                        y = run_path(path, x, weights[0], res)
                        x64 = x.double() if path in ("gemv", "skinny16") else quantized_activations(x, block)
                        err = dot_error(y, x64, w64, None if residual is None else residual.double())
                        accuracy.append({"shape": name, "mode": mode, "path": path, "rows": m, "dot_rel": err})
                errors.update({f"{name} {mode} {p}": e for p, e in failed.items()})
                print(
                    f"  {name:8s} {mode:7s} M={m:<3d} bf16 {bf16_us:7.2f}  " + "  ".join(cells) + "   (* = dispatch)",
                    flush=True,
                )
            del w64
            if args.sweep:
                sweeps += sweep(name, n, k, mode, block, weights, gen, args.sweep.split(","))
            del weights
            torch.cuda.empty_cache()

    print("measured dot-product error (GPU tests' dot_rel needed), worst per path and mode:")
    for mode, path in itertools.product(("channel", "block"), fp8.PATHS):
        errs = [a["dot_rel"] for a in accuracy if a["mode"] == mode and a["path"] == path]
        if errs:
            print(f"  {mode:7s} {path:9s} {max(errs):.2e}")
    step = {}
    print("one decode step's projections (32 layers x qkv, o_proj, gate_up, down + lm_head), ms:")
    for m in (1, 8):
        if m not in rows_list:
            continue
        for mode in ("bf16", "channel", "block"):
            total = 0.0
            for name in SHAPES:
                mine = [r for r in results if r["shape"] == name and r["mode"] == mode and r["rows"] == m]
                if not mine:
                    break
                best = next((r for r in mine if r.get("chosen")), mine[0]) if mode != "bf16" else mine[0]
                total += best["us"] * (1 if name == "lm_head" else 32)
            else:
                step[f"{mode} M={m}"] = total / 1000
        line = "  ".join(f"{key} {ms:.3f}" for key, ms in step.items() if key.endswith(f"M={m}"))
        print(f"  M={m}: {line}")
        base = step.get(f"bf16 M={m}")
        for mode in ("channel", "block"):
            if base and f"{mode} M={m}" in step:
                print(f"    {mode}: {base / step[f'{mode} M={m}']:.2f}x the bf16 projections")
    config = {
        "shapes": {name: SHAPES[name] for name in args.shapes.split(",")},
        "rows": rows_list,
        "dispatch": dataclasses.asdict(fp8.DISPATCH),
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": "one CUDA graph over distinct weight copies (>= 256 MiB FP8), us per matmul, median of 5 x 20 replays",
    }
    metrics = {
        "matmuls": results, "accuracy": accuracy, "decode_step_projections_ms": step, "sweep": sweeps,
        "path_errors": errors,
    }  # fmt: skip
    print(f"wrote {write_result('fp8-linear-microbench', config, metrics, args.result_dir, args.result_name)}")


if __name__ == "__main__":
    main()
