"""Batch-1 decode matmuls of Llama-3.1-8B under each cuBLAS entry point torch offers.

For every projection (qkv, o_proj, gate_up, down) one CUDA graph of 32 matmuls over 32
distinct weights (as a decode step reads them), in us per matmul, for: the weight stored
in-major (as CausalLM keeps it on CUDA) or out-major; torch's cuBLAS or cuBLASLt backend
(`torch.backends.cuda.preferred_blas_library`, read at each call, so it can differ per
projection); and for o_proj / down the in-place residual add (`addmm_`, beta = 1) that the
deferred-norm decode path uses. A choice that wins for one projection could be made for it
alone.

    PYTHONPATH=src python3 benchmarks/cublas_backend_microbench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemv_microbench import graph_ms  # benchmarks/ is on sys.path when run as a script

from tokenmill.bench.latency import copy_bandwidth

SHAPES = {  # name: (out, in)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
COPIES = 32


def main() -> None:
    bandwidth = copy_bandwidth("cuda")
    print(
        f"{torch.cuda.get_device_name(0)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; us per matmul (fraction of copy)"
    )
    device = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        ideal_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        residual = torch.randn(1, n, device=device, dtype=torch.bfloat16)
        for layout in ("in-major", "out-major"):
            if layout == "in-major":
                weights = [torch.randn(k, n, device=device, dtype=torch.bfloat16).t() for _ in range(COPIES)]
            else:
                weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                calls = {"linear": [lambda w=w, x=x: F.linear(x, w) for w in weights]}
                if name in ("o_proj", "down"):
                    calls["addmm_"] = [lambda w=w, x=x, r=residual: r.addmm_(x, w.t()) for w in weights]
                for kind, fns in calls.items():
                    us = graph_ms(fns) * 1000 / COPIES
                    print(
                        f"  {name:8s} {layout:9s} {backend:8s} {kind:7s} {us:7.2f} us ({ideal_us / us:.2f})"
                    )
            del weights
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
