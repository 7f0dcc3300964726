"""The engine's compute kernels, each beside the thin Python wrapper that launches it.

- `triton/`: GPU kernels in Triton (paged attention and the KV store, row GEMV, skinny GEMM, fused
  norm / RoPE / SiLU, greedy sampling). They also run under `TRITON_INTERPRET=1` on the CPU.
- `cpu/`: C++ kernels for the CPU (`cpu/csrc/*.cpp`: paged attention, GGUF-quantized GEMV), built
  on first use by `cpu/build.py` into one library.

Nothing here imports triton or builds C++ at package import: triton is optional on CPU-only installs.
Layers and backends above (`attention/`, `model/`, `sample/`, `worker/`) choose when a kernel runs.
"""
