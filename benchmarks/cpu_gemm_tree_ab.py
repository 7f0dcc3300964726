"""The AVX2 batched 16-bit-activation CPU product (csrc/cpu_quant_gemm_int16_avx2.cpp) of two
source trees, in one process, calls alternating: the only A/B of a kernel change that held up on this project's shared 2-core VMs,
where separate processes differed by 15-20 % from host noise alone and from where the heap put the
kernel's buffers.

Both trees' kernel sources are copied with their namespace renamed (`tm_old`, `tm_new`) and built
into one extension (with each tree's helper pool, not started: one thread), then, per shape,
random Q4_1 weight copies (more than the L3 holds, as a decode step's weights) are multiplied in
turn by the same float32 rows, old and new alternating and swapping order each pass. Prints and
writes the median and best ms a call of each and old / new on the medians.

    PYTHONPATH=src taskset -c 1 python benchmarks/cpu_gemm_tree_ab.py --old-tree /work/wt/base \\
        --new-tree . --shapes 3072x576x64,576x1536x64,960x576x512 --seconds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenmill.bench.results import write_result

_KERNEL_FILES = ("cpu_helper_pool.cpp", "helper_pool.h", "int16_panel.h", "quant_gemm_int16_avx2.h")
_BINDING = """
#include <torch/extension.h>
namespace tm_old { void %(fn)s(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, bool); }
namespace tm_new { void %(fn)s(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, bool); }
template <int V> void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, int64_t num_blocks) {
  auto f = V == 0 ? tm_old::%(fn)s : tm_new::%(fn)s;
  f(x.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), x.size(0), w.size(0), num_blocks, true);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("old", &run<0>); m.def("new", &run<1>); }
"""


def build(old_tree: Path, new_tree: Path, directory: Path):
    """Both trees' kernels, namespaces renamed, in one extension module."""
    from torch.utils import cpp_extension

    from tokenmill.kernels.cpu.build import load_cpu_kernels
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_isa

    load_cpu_kernels()
    isa = int8_isa()  # the package's own -march=native build says which 16-bit kernel this CPU gets
    if isa != "avx2":
        # The VNNI kernel (cpu_quant_gemm_vnni.cpp) has no plain entry point outside its torch op, and
        # such a build (or one without AVX2) compiles the AVX2 file to a stub.
        raise SystemExit(f"this A/B covers the AVX2 kernel only; this build's kernels are {isa or 'scalar'}")
    source, fn = "cpu_quant_gemm_int16_avx2.cpp", "gemm_int16_avx2"
    sources = []
    for tag, tree in (("old", old_tree), ("new", new_tree)):
        csrc = tree / "src/tokenmill/kernels/cpu/csrc"
        out = directory / tag
        out.mkdir(parents=True)
        for name in (source, *_KERNEL_FILES):
            text = (csrc / name).read_text().replace("namespace tokenmill_cpu", f"namespace tm_{tag}")
            # the op registrations would collide between the two copies (and with the package's)
            text = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(tokenmill_cpu.*?\n\}", "", text, flags=re.S)
            target = name if name.endswith(".h") else name.replace(".cpp", f"_{tag}.cpp")
            (out / target).write_text(text)
            if not name.endswith(".h"):
                sources.append(str(out / target))
    binding = directory / "binding.cpp"
    binding.write_text(_BINDING % {"fn": fn})
    sources.append(str(binding))
    print(f"building the {isa} kernels of {old_tree} (old) and {new_tree} (new) ...", flush=True)
    cpp_extension.load(
        name="tm_gemm_tree_ab",
        sources=sources,
        build_directory=str(directory),
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    spec = importlib.util.spec_from_file_location("tm_gemm_tree_ab", directory / "tm_gemm_tree_ab.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return isa, module


def _sibling(name: str):
    """A script next to this one, loaded by path: benchmarks/ is not on sys.path when this file
    runs through runpy (the --help test) or from another directory."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(module, n: int, k: int, m: int, seconds: float) -> dict:
    random_q4_1_rows = _sibling("quant_gemm_microbench").random_q4_1_rows
    from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows

    rng = np.random.default_rng(0)
    copies = max(1, min(30, (48 << 20) // (n * k // 32 * 20)))
    weights = [torch.from_numpy(vnni_rows(random_q4_1_rows(rng, n, k), 0)) for _ in range(copies)]
    x = torch.randn(m, k)
    out = {"old": torch.empty(m, n), "new": torch.empty(m, n)}
    module.old(x, weights[0], out["old"], k // 32)
    module.new(x, weights[0], out["new"], k // 32)
    difference = (out["old"] - out["new"]).abs().max().item()
    times: dict[str, list[float]] = {"old": [], "new": []}
    end = time.monotonic() + seconds
    passes = 0
    while time.monotonic() < end:
        order = ("old", "new") if passes % 2 else ("new", "old")
        for w in weights:
            for tag in order:
                start = time.perf_counter()
                getattr(module, tag)(x, w, out[tag], k // 32)
                times[tag].append(time.perf_counter() - start)
        passes += 1
    row = {"n": n, "k": k, "m": m, "calls": len(times["old"]), "max_abs_difference": difference}
    for tag in ("old", "new"):
        row[f"{tag}_median_ms"] = 1000 * statistics.median(times[tag])
        row[f"{tag}_best_ms"] = 1000 * min(times[tag])
    row["old_over_new"] = row["old_median_ms"] / row["new_median_ms"]
    row["new_gmacs"] = m * n * k / row["new_median_ms"] / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-tree", type=Path, required=True, help="a checkout (e.g. a git worktree of the base)")
    parser.add_argument("--new-tree", type=Path, default=Path("."))
    parser.add_argument("--shapes", default="3072x576x64,576x1536x64,960x576x512,3072x576x32",
                        help="comma-separated NxKxM (outputs x inputs x activation rows)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per shape")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's serving default: 1)")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tm-gemm-ab-") as directory:
        isa, module = build(args.old_tree.resolve(), args.new_tree.resolve(), Path(directory))
        rows = []
        for shape in args.shapes.split(","):
            n, k, m = (int(v) for v in shape.split("x"))
            row = compare(module, n, k, m, args.seconds)
            rows.append(row)
            print(
                f"{n:5d} x {k:4d}, {m:3d} rows: old {row['old_median_ms']:.3f} ms (best {row['old_best_ms']:.3f}), "
                f"new {row['new_median_ms']:.3f} ms (best {row['new_best_ms']:.3f}): old / new "
                f"{row['old_over_new']:.3f}, {row['new_gmacs']:.1f} G multiply-adds/s; "
                f"max |old - new| {row['max_abs_difference']:.3g}",
                flush=True,
            )
    config = {"isa": isa, "old_tree": str(args.old_tree), "new_tree": str(args.new_tree), "threads": args.threads,
              "seconds": args.seconds}
    path = write_result("cpu-gemm-tree-ab", config, {"shapes": rows}, out_dir=args.result_dir, name=args.result_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
