"""SiLU-and-multiply fused into the down projection, for one-row (single-request decode) steps.

At batch 1 the MLP's tail is three launches through cuBLAS: the SiLU-mul kernel, a split-K GEMV
for down_proj, and cuBLAS's split-K reduce. Here it is one: each program computes
silu(gate) * up for its slice of the intermediate vector as it reads the matching rows of the
in-major down weight, and the last program of a column block to finish sums the K splits (an
atomic count per column block, reset by that program, so CUDA graph replays need no memset).

Rounding follows the separate kernels: silu(gate) is rounded to the model dtype before the
multiply by up, and the product before the matmul, as `triton_ops.silu_mul` writes it.

Measured against the unfused path in BENCHMARKS.md; `TOKENMILL_FUSED_SILU_DOWN` in llama.py
chooses it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton_kernels.rounding import round_like


@triton.jit
def _silu_mul_down_kernel(
    gate_up_ptr,  # [2 * intermediate]: gate then up
    w_ptr,  # [intermediate, N] row-major: the down weight stored in-major
    y_ptr,  # [N]
    partial_ptr,  # float32 [SPLIT_K, N]
    counter_ptr,  # int32 [cdiv(N, BLOCK_N)], zero between calls
    N,
    intermediate,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ON_GPU: tl.constexpr,  # a real GPU (not the interpreter): emit the memory fence
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = gate_up_ptr.dtype.element_ty
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_begin + k0 + rows
        k_ok = k < intermediate
        gate = tl.load(gate_up_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + intermediate + k, mask=k_ok, other=0.0).to(tl.float32)
        act = round_like(gate / (1.0 + tl.exp(-gate)), dtype)
        x = round_like(act * up, dtype)
        w = tl.load(
            w_ptr + k[:, None].to(tl.int64) * N + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",  # read once a step: keep L2 for the activations
        )
        acc += w.to(tl.float32) * x[:, None]
    partial = tl.sum(acc, axis=0)
    if SPLIT_K == 1:
        tl.store(y_ptr + cols, partial.to(y_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(partial_ptr + pid_k * N + cols, partial, mask=col_ok)
        if ON_GPU:
            # Every thread's partial stores are ordered before the count, GPU-wide.
            tl.inline_asm_elementwise(
                "fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r,r", [pid_k], dtype=tl.int32, is_pure=False, pack=1
            )
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            splits = tl.arange(0, SPLIT_K)
            parts = tl.load(
                partial_ptr + splits[:, None] * N + cols[None, :],
                mask=col_ok[None, :],
                other=0.0,
                cache_modifier=".cg",  # written by other SMs: read through L2, not a stale L1
            )
            tl.store(y_ptr + cols, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=col_ok)
            tl.atomic_xchg(counter_ptr + pid_n, 0)


BLOCK_N = 128
BLOCK_K = 64
MAX_SPLIT_K = 64


def split_count(n: int, intermediate: int, num_sms: int) -> int:
    """K splits (a power of two) so the grid has about 4 programs per SM, each still streaming at
    least 4 tiles of the weight."""
    col_blocks = triton.cdiv(n, BLOCK_N)
    split = 1
    while (
        split < MAX_SPLIT_K
        and col_blocks * split < 4 * num_sms
        and intermediate // (split * 2) >= 4 * BLOCK_K
    ):
        split *= 2
    return split


class SiluMulDown:
    """The workspace (float32 partials, arrival counters) for one device and one down weight
    shape; call it with gate_up [1, 2 * I] and the down weight [N, I] stored in-major."""

    def __init__(self, n: int, intermediate: int, device: torch.device) -> None:
        num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        )
        self.n, self.intermediate = n, intermediate
        self.split_k = split_count(n, intermediate, num_sms)
        self.k_per_split = triton.cdiv(triton.cdiv(intermediate, self.split_k), BLOCK_K) * BLOCK_K
        self.partials = torch.empty(self.split_k * n, dtype=torch.float32, device=device)
        self.counters = torch.zeros(triton.cdiv(n, BLOCK_N), dtype=torch.int32, device=device)
        self.on_gpu = device.type == "cuda"

    def supports(self, gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            gate_up.dim() == 2
            and gate_up.shape[0] == 1
            and gate_up.shape[1] == 2 * self.intermediate
            and gate_up.stride(-1) == 1
            and tuple(weight.shape) == (self.n, self.intermediate)
            and weight.t().is_contiguous()
            and gate_up.dtype == weight.dtype
            and gate_up.device == self.partials.device
        )

    def __call__(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.supports(gate_up, weight):
            raise ValueError(
                f"SiluMulDown({self.n}, {self.intermediate}) needs gate_up [1, {2 * self.intermediate}] "
                f"and an in-major down weight [{self.n}, {self.intermediate}] of the same dtype; got "
                f"{tuple(gate_up.shape)} {gate_up.dtype} and {tuple(weight.shape)} {weight.dtype}"
            )
        y = torch.empty((1, self.n), dtype=gate_up.dtype, device=gate_up.device)
        grid = (triton.cdiv(self.n, BLOCK_N), self.split_k)
        _silu_mul_down_kernel[grid](
            gate_up, weight.t(), y, self.partials, self.counters, self.n, self.intermediate,
            K_PER_SPLIT=self.k_per_split, SPLIT_K=self.split_k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            ON_GPU=self.on_gpu, num_warps=4,
        )  # fmt: skip
        return y
