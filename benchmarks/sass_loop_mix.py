"""Compile the one-row decode GEMVs for an H100 / H200 (sm_90) on a machine without a GPU and
print what their main loops issue: shared memory, SASS instructions of the loop, the mix, and
instructions per weight. The one-row GEMVs are issue- and latency-bound (ncu, BENCHMARKS.md), so
these counts are a cheap first check of a kernel change before a device call, not a timing.

    PYTHONPATH=src python benchmarks/sass_loop_mix.py                 # every kernel, Llama-3.1-8B shapes
    PYTHONPATH=src python benchmarks/sass_loop_mix.py --kernels int4 --shapes gate_up --kernel-config '{"int4_zero_by_xsum": true}'

Each case runs the real launcher (`int4_linear`, `fp8_gemv`, `fp8_tc_gemv`) on CPU tensors of the
shape, catches its kernel launch, and compiles that launch as Triton's JIT would on the GPU: the
same arguments, so the same specialization (pointers and integers divisible by 16, integers equal
to 1 folded in), which matters: without it the x loads are not pipelined and the counts mislead.
Constexprs that the launcher sets from the device (inline-PTX dequantization, float32 dots for the
interpreter) are set as on CUDA. The local Triton may be newer than the device's: the SASS is
indicative. Needs no GPU; the compiler's bundled nvdisasm reads the binary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Launcher constexprs that name the device, set as a CUDA launch sets them.
CUDA_CONSTEXPRS = {"ASM": True, "UPCAST_DOT": False}


class _Captured(Exception):
    def __init__(self, fn, args: tuple, kwargs: dict) -> None:
        super().__init__("launch captured")
        self.fn, self.args, self.kwargs = fn, args, kwargs


def capture_launch(fn, call: Callable[[], Any]) -> _Captured:
    """Run `call` until it launches the JIT kernel `fn`; return that launch's arguments."""

    def run(*args, grid, warmup, **kwargs):
        raise _Captured(fn, args, kwargs)

    original = fn.run
    fn.run = run
    try:
        call()
    except _Captured as launch:
        return launch
    finally:
        fn.run = original
    raise RuntimeError(f"{fn.__name__} was not launched")


def compile_for_sm90(launch: _Captured):
    """The launch compiled for sm_90 as the JIT would: Triton's own binder and argument packing."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.kwargs, **{k: v for k, v in CUDA_CONSTEXPRS.items() if k in launch.kwargs}}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def sass_of(kernel) -> str:
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True
        ).stdout


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def main_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop body (a label up to a branch back to it)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [op.group(1) for x in lines[labels[m.group(1)] : i + 1] if (op := _INSTRUCTION.match(x))]
            best = max(best, body, key=len)
    return best


def weights_per_iteration(kernel_name: str, constexprs: dict[str, Any], num_warps: int) -> int | None:
    """Weights one warp multiplies per iteration of the main loop."""
    if kernel_name == "int4_matmul_kernel":
        return constexprs["BLOCK_N"] * 8 * constexprs["CHUNK"] // num_warps
    if kernel_name in ("_fp8_gemv_kernel", "_fp8_tc_gemv_kernel"):
        return constexprs["BLOCK_N"] * constexprs["BLOCK_K"] // num_warps
    return None


def cases(kernels: list[str], shapes: list[str], kernel_config: dict[str, Any]):
    """(label, JIT function, the launcher call) per kernel and shape, one row of x."""
    import torch

    from tokenmill.kernels.triton import fp8_gemv, fp8_tc_gemv, int4_kernel
    from tokenmill.kernels.triton.int4_linear import int4_linear, prepare_int4_weights

    x_dtype = torch.bfloat16
    for name in shapes:
        n, k = SHAPES[name]
        residual = torch.zeros(1, n, dtype=x_dtype) if name in ("o_proj", "down") else None
        x = torch.zeros(1, k, dtype=x_dtype)
        if "int4" in kernels:
            groups = k // 128
            w = prepare_int4_weights(
                torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, groups, dtype=x_dtype),
                torch.full((n, groups), 8, dtype=torch.uint8), 128,
            )  # fmt: skip
            xsum = bool(kernel_config.get("int4_zero_by_xsum", False))
            yield (f"int4 {name}" + (" xsum" if xsum else ""), int4_kernel.int4_matmul_kernel,
                   lambda x=x, w=w, r=residual, xs=xsum: int4_linear(x, w, residual=r, zero_by_xsum=xs))  # fmt: skip
        if "fp8" in kernels or "tc16" in kernels:
            weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
            scale = torch.ones(n)
            counters = torch.zeros(n, dtype=torch.int32)
        if "fp8" in kernels:
            yield (f"fp8 gemv {name}", fp8_gemv._fp8_gemv_kernel,
                   lambda x=x, wt=weight, s=scale, r=residual, c=counters: fp8_gemv.fp8_gemv(
                       x, wt, s, None, residual=r, tile_counters=c))  # fmt: skip
        if "tc16" in kernels:
            yield (f"fp8 tc16 {name}", fp8_tc_gemv._fp8_tc_gemv_kernel,
                   lambda x=x, wt=weight, s=scale, r=residual, c=counters: fp8_tc_gemv.fp8_tc_gemv(
                       x, wt, s, c, residual=r))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kernels", nargs="+", default=["int4", "fp8", "tc16"], choices=["int4", "fp8", "tc16"]
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--kernel-config", type=json.loads, default={},
                        help="KernelConfig keys the cases honour: int4_zero_by_xsum")  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the launchers must reach the JIT, not the interpreter

    for label, fn, call in cases(args.kernels, args.shapes, args.kernel_config):
        launch = capture_launch(fn, call)
        kernel = compile_for_sm90(launch)
        loop = main_loop(sass_of(kernel))
        mix = collections.Counter(loop)
        constexprs = {**launch.kwargs}
        warps = launch.kwargs.get("num_warps", 4)
        per_iteration = weights_per_iteration(fn.__name__, constexprs, warps)
        per_weight = f"{len(loop) / per_iteration:.4f}" if per_iteration else "?"
        tiles = {
            key: launch.kwargs[key]
            for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_stages")
            if key in launch.kwargs
        }
        print(f"{label:<22} warps {warps} {tiles} smem {kernel.metadata.shared} B; loop {len(loop)} instructions "
              f"a warp, {per_weight} a weight")  # fmt: skip
        print("    " + ", ".join(f"{op} {count}" for op, count in mix.most_common(args.top)))


if __name__ == "__main__":
    main()
