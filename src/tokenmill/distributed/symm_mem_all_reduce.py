"""A one-shot all-reduce over symmetric memory for the small messages of decode steps.

Why: a decode step of Llama-3.1-70B at TP=4 does 160 all-reduces of a few KB each, and NCCL's
kernels cost about 18 us apiece however small the message (2 x H200, in CUDA graphs): at TP=4 the
step reached 0.640 of the bandwidth roofline. A one-shot
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
import socket

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The dtypes the one-shot kernel reduces (it refuses the others).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One-shot reads every peer's whole message, so it wins while the message is small; a decode step
# of 64 requests at hidden size 8192 in bf16 is 1 MiB.
DEFAULT_MAX_BYTES = 1 << 20


def why_not_usable() -> str | None:
    """Why this NCCL group cannot use the one-shot kernel (None: it can). Collective: every rank
    calls it and gets the same answer, since a rank that took the kernel while a peer took NCCL
    would hang both. The kernel reads peers' memory through CUDA IPC, so every rank must be on one
    host, on its own GPU, with peer access to every other rank's GPU (NVLink, or PCIe P2P where the
    platform allows it; consumer GPUs often do not)."""
    device = torch.cuda.current_device()
    ranks = _gather({
        "host": socket.gethostname(),
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "symm_mem": hasattr(torch.ops.symm_mem, "one_shot_all_reduce"),
    })  # fmt: skip
    reason = reason_from_facts(ranks, torch.__version__)
    if reason is not None:
        return reason
    # Peer access is asked by device index, which names the same GPU to every rank only if they all
    # see the same devices: each rank checks the peers it can see, and all must agree.
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    peers = [visible.get(r["uuid"]) for r in ranks]
    local_ok = all(
        i is not None and (i == device or torch.cuda.can_device_access_peer(device, i)) for i in peers
    )
    if not all(_gather(local_ok)):
        return "some rank's GPU has no peer access to another's (or cannot see it)"
    return None


def reason_from_facts(ranks: list[dict], torch_version: str) -> str | None:
    """The part of why_not_usable that needs no device: each rank's host, GPU and torch build."""
    if not all(r["symm_mem"] for r in ranks):
        return f"this torch build ({torch_version}) has no symmetric-memory one-shot all-reduce"
    if len({r["host"] for r in ranks}) > 1:
        return "the ranks span several hosts (CUDA IPC reaches one host's GPUs only)"
    if len({r["uuid"] for r in ranks}) < len(ranks):
        return "two ranks share a GPU"
    return None


def _gather(value: object) -> list:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class SymmMemAllReduce:
    """The sum over every rank of a small CUDA tensor, through one symmetric byte buffer (viewed as
    the tensor's dtype)."""

    def __init__(self, device: torch.device, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Allocates and maps the buffer now: a collective, so every rank builds this at the same
        point (init_tensor_parallel). Made lazily, it would come from whichever eager forward first
        passed a small all-reduce, and a graph captured before that (a rendezvous cannot be
        captured) would keep NCCL's; mapped up front, every captured size up to `max_bytes`
        takes the one-shot kernel."""
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name = dist.group.WORLD.group_name
        # One byte buffer, viewed as each dtype: the kernel finds the mapping from the storage.
        try:
            self._buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self._buffer, self.group_name)
        except RuntimeError as exc:
            raise RuntimeError(
                f"mapping the one-shot all-reduce's symmetric buffer on {device} failed ({exc}); "
                "start without --enable-custom-all-reduce to send every all-reduce through NCCL"
            ) from exc
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
