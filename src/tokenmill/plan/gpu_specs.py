"""The accelerators `tokenmill plan` knows: memory, memory bandwidth and dense tensor throughput.

Vendor datasheet figures (dense, no sparsity). Where a figure comes from:
- H100: NVIDIA H100 Tensor Core GPU datasheet, SXM5 80 GB column: HBM3 3.35 TB/s, BF16 989.4
  TFLOPS and FP8 1,978.9 TFLOPS dense (the sheet's 1,979 / 3,958 are with sparsity). The device our
  benchmarks ran on reports itself as "NVIDIA H100 80GB HBM3" (SXM).
- H200: NVIDIA H200 Tensor Core GPU datasheet, SXM column: 141 GB HBM3e at 4.8 TB/s; same Hopper
  tensor cores as H100 SXM (989 BF16 / 1,979 FP8 dense).
- A100: NVIDIA A100 datasheet, 80 GB SXM: HBM2e 2,039 GB/s, BF16 312 TFLOPS; no FP8 tensor cores
  (FP8 weights would run as a weight-only format: the planner charges BF16 compute).
- L40S: NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, BF16 362 TFLOPS and FP8 733 TFLOPS dense
  (the sheet's 733 / 1,466 are with sparsity).
- cpu: no datasheet; a nominal dual-channel DDR5 desktop (~60 GB/s, ~1 TFLOPS FP32 with AVX-512,
  32 GB). Uncalibrated: read its figures as an order of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float  # peak memory bandwidth
    bf16_flops: float  # dense tensor FLOP/s at 16 bits
    fp8_flops: float | None  # dense FP8 FLOP/s; None: no FP8 tensor cores
    source: str

    def flops(self, fp8: bool) -> float:
        return self.fp8_flops if fp8 and self.fp8_flops is not None else self.bf16_flops


GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 80 * 2**30, 3.35 * TB, 989.4 * TB, 1978.9 * TB, "NVIDIA H100 datasheet (SXM5 80 GB)"),
    "H200": GpuSpec("H200", 141 * GB, 4.8 * TB, 989.4 * TB, 1978.9 * TB, "NVIDIA H200 datasheet (SXM 141 GB)"),
    "A100": GpuSpec("A100", 80 * 2**30, 2.039 * TB, 312 * TB, None, "NVIDIA A100 datasheet (SXM 80 GB)"),
    "L40S": GpuSpec("L40S", 48 * 2**30, 0.864 * TB, 362 * TB, 733 * TB, "NVIDIA L40S datasheet"),
    "cpu": GpuSpec("cpu", 32 * 2**30, 60 * GB, 1 * TB, None, "nominal DDR5 desktop (no datasheet; uncalibrated)"),
}


def gpu_spec(name: str) -> GpuSpec:
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown --gpu {name!r}; choose one of {', '.join(GPUS)}")
