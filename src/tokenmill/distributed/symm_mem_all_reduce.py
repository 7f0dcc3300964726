"""A one-shot all-reduce over symmetric memory for the small messages of decode steps.

Why: a decode step of Llama-3.1-70B at TP=4 does 160 all-reduces of a few KB each, and NCCL's
ring / tree kernels cost about 25 us apiece however small the message (fitted 23.7 us at TP=2 on
H200s): at TP=4 that was a third of the step (0.640 of the bandwidth roofline). A one-shot
all-reduce needs one kernel: every rank copies its partial sums into a buffer that every peer has
mapped (CUDA IPC over NVLink), the ranks meet at a device-side barrier, and each reads all the
peers' copies and adds them. torch's symmetric memory provides the mapped buffer, the barrier
(signal pads, safe to replay in a CUDA graph) and that kernel (`symm_mem::one_shot_all_reduce`).
NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, the device's KINDS.md): the
one-shot kernel reads peers with plain loads and never uses it.

Messages above `max_bytes` (prefill chunks) and anything the kernel does not take (CPU tensors,
other dtypes, non-contiguous views) go to NCCL: every rank makes the same choice from the same
shape, so the collectives still line up.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The dtypes the one-shot kernel reduces (it refuses the others).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One-shot reads every peer's whole message, so it wins while the message is small; a decode step
# of 64 requests at hidden size 8192 in bf16 is 1 MiB.
DEFAULT_MAX_BYTES = 1 << 20


class SymmMemAllReduce:
    """The sum over every rank of a small CUDA tensor, through one symmetric byte buffer (viewed as
    the tensor's dtype)."""

    def __init__(self, device: torch.device, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Allocates and maps the buffer now: a collective, so every rank builds this at the same
        point (init_tensor_parallel). Made lazily it would not exist when the first small
        all-reduce is captured into a decode graph (a rendezvous cannot be captured, and the
        engine's eager warm-up steps are prefill-sized, above `max_bytes`), so every captured
        all-reduce would stay NCCL's. The first GPU run made it lazily: 2.8x faster per call in
        the microbenchmark, a decode step no faster."""
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name = dist.group.WORLD.group_name
        # One byte buffer, viewed as each dtype: the kernel finds the mapping from the storage.
        self._buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self._buffer, self.group_name)
        # one_shot_all_reduce_copy (copy-in fused into the kernel) is newer than one_shot_all_reduce.
        self._fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
        logger.info("one-shot all-reduce: %d KiB symmetric buffer on %s", max_bytes // 1024, device)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the one-shot kernel (else NCCL): the same answer on every
        rank for the same shape and dtype, so the ranks' collectives still pair up."""
        return (
            x.is_cuda
            and x.dtype in SUPPORTED_DTYPES
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced tensor (a new one; `x` is left as it was)."""
        staging = self._buffer.view(x.dtype)[: x.numel()].view(x.shape)
        if self._fused_copy:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)
        staging.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staging, "sum", self.group_name)
