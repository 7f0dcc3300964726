"""Top-k routing of a mixture-of-experts layer in one launch: softmax over the router logits, the
k most likely experts, optionally renormalized to sum to 1.

transformers does it in four or five launches (softmax in float32, topk, sum, divide, cast); a
decode step runs it once per MoE layer, so here one program takes one token's row: it reads the
logits once, keeps the probabilities in registers and picks the k largest by k rounds of
arg-max over packed (probability, expert) keys (ties go to the lower expert id). The weights
come out in float32, rounded to the logits' dtype first when the model rounds them there (Qwen's
routers do, Mixtral's do not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.rms import scale_rounded
from tokenmill.kernels.triton.rounding import round_like


@triton.jit
def topk_of_row(
    row_ptr,  # one token's router logits [E], contiguous
    num_experts,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO_LOGITS_DTYPE: tl.constexpr,
    logit_scale,
    SCALE_LOGITS: tl.constexpr,
):
    """(weights [TOP_K_PAD] float32, expert ids [TOP_K_PAD] int32) of one token; slots past
    TOP_K hold zeros. Shared with the few-token experts kernel (fused_moe_gemv.py), which routes
    inside its own launch. With SCALE_LOGITS the stored logits are first multiplied by
    `logit_scale` (> 0) and rounded to their dtype: the deferred norm's 1/rms, when the router
    projected the un-normalized row (see fused_moe_gemv.py)."""
    experts = tl.arange(0, EXPERTS_PAD)
    is_expert = experts < num_experts
    logits = tl.load(row_ptr + experts, mask=is_expert, other=float("-inf"))
    if SCALE_LOGITS:
        logits = scale_rounded(logits, logit_scale)
    logits = logits.to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    # One reduction per pick: a probability (>= +0) orders as its float32 bit pattern does, so a
    # key of those bits above the inverted expert id makes one integer max pick the most likely
    # expert and, among equal probabilities, the lowest id (a max, then a min over the ties,
    # took two dependent reductions, all before the experts kernel's first weight load).
    tl.static_assert(EXPERTS_PAD <= 65536)
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(is_expert, (bits << 16) | (65535 - experts).to(tl.int64), -1)  # padding is never picked
    slots = tl.arange(0, TOP_K_PAD)
    top_values = tl.zeros([TOP_K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([TOP_K_PAD], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        best_id = (65535 - (best & 65535)).to(tl.int32)
        best_prob = (best >> 16).to(tl.int32).to(tl.float32, bitcast=True)
        top_values = tl.where(slots == slot, best_prob, top_values)
        top_ids = tl.where(slots == slot, best_id, top_ids)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALIZE:
        top_values = top_values / tl.sum(top_values, axis=0)
    if ROUND_TO_LOGITS_DTYPE:
        top_values = round_like(top_values, row_ptr.dtype.element_ty)
    return top_values, top_ids


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E], rows contiguous
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int32
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_TO_LOGITS_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    top_values, top_ids = topk_of_row(
        logits_ptr + row * stride_logits, num_experts, TOP_K, TOP_K_PAD, EXPERTS_PAD, RENORMALIZE,
        ROUND_TO_LOGITS_DTYPE, 1.0, False,
    )  # fmt: skip
    slots = tl.arange(0, TOP_K_PAD)
    in_k = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_values, mask=in_k)
    tl.store(ids_ptr + row * TOP_K + slots, top_ids, mask=in_k)


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_to_logits_dtype: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int32) for router logits [T, E]; the
    weights rounded to the logits' dtype (and kept in float32) with `round_to_logits_dtype`."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        raise ValueError("topk_softmax needs router logits with contiguous rows")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    _topk_softmax_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        EXPERTS_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
        ROUND_TO_LOGITS_DTYPE=round_to_logits_dtype,
        num_warps=1 if num_experts <= 64 else 2,
    )
    return weights, ids

