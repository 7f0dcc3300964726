"""Triton kernels: the KV-store scatter and paged attention (behind `TritonPagedBackend`), the row
GEMV and skinny GEMM (few-row matmuls), fused elementwise ops of the decoder, greedy sampling.

They run compiled on CUDA and, for tiny shapes, under `TRITON_INTERPRET=1` on the CPU (that is
how CI checks them).
"""
