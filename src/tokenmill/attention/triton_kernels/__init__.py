"""Triton kernels behind `TritonPagedBackend`: the KV-store scatter and paged attention.

They run compiled on CUDA and, for tiny shapes, under `TRITON_INTERPRET=1` on the CPU (that is
how CI checks them).
"""
