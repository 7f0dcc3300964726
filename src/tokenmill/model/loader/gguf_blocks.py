"""Attach a GGUF file's Q4_1 / Q8_0 blocks to the linear layers they belong to, for few-row steps.

Any model family whose CausalLM maps checkpoint names to linear layers (`linear_for_weight`) gets
this for free: a merged layer (qkv, gate_up) gets blocks only when all its parts come, in the
same type; the blocks are concatenated in the layer's shard order. A file that stores the merged
layer as one tensor (Phi-3) gives it that tensor's blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from tokenmill.kernels.cpu.quant_gemv import QuantizedBlocks, gemm_vnni16_available, split_rows
from tokenmill.kernels.cpu.quant_gemv_int8 import vnni_rows
from tokenmill.model.layers.linear import LinearBase, ShardId
from tokenmill.model.layers.quantized_linear import attach_quantized_blocks


class _MapsWeightsToLinears(Protocol):
    qk_dim_order: torch.Tensor | None  # set where the model permutes q/k rows at load (partial rotary)

    def linear_for_weight(self, name: str) -> tuple[LinearBase, ShardId] | None: ...

    def rows_in_model_layout(self, rows: torch.Tensor, shard_id: ShardId) -> torch.Tensor: ...


def attach_gguf_blocks(
    model: _MapsWeightsToLinears,
    quantized: Iterable[tuple[str, int, np.ndarray]],
    gemm_rows: int = 0,
    activation_bits: int = 0,
    before_loading: bool = False,
) -> int:
    """Give each linear layer whose whole weight comes quantized (loader.gguf_loader.iter_gguf_quantized)
    a GGUFBlocksMethod over its blocks (and, with `activation_bits` 8 or 16, the same blocks in the
    quantized-activation kernel's layout too: both layouts stay, the float batched kernel reads the first,
    except where the VNNI batched kernel serves every row count from the second). Only unsharded
    layers (tp_size 1). `before_loading`: see attach_quantized_blocks. Returns the bytes attached."""
    parts: dict[int, tuple[LinearBase, dict[ShardId, tuple[int, np.ndarray]]]] = {}
    for name, code, rows in quantized:
        target = model.linear_for_weight(name)
        if target is None:
            continue
        layer, shard_id = target
        if model.qk_dim_order is not None:
            # Whole rows move as the model moved the float weight's (partial rotary's q/k head
            # dimensions); a copy, the file's memory map being read-only.
            rows = model.rows_in_model_layout(torch.from_numpy(np.array(rows)), shard_id).numpy()
        parts.setdefault(id(layer), (layer, {}))[1][shard_id] = (code, rows)
    attached = 0
    for layer, shards in parts.values():
        blocks = _blocks_for(layer, shards, activation_bits)
        if blocks is not None:
            attach_quantized_blocks(layer, blocks, gemm_rows, before_loading=before_loading)
            attached += sum(t.nbytes for t in (blocks.blocks, blocks.vnni) if t is not None)
    return attached


def _blocks_for(
    layer: LinearBase, shards: dict[ShardId, tuple[int, np.ndarray]], activation_bits: int
) -> QuantizedBlocks | None:
    order: tuple[ShardId, ...] = getattr(layer, "shard_ids", (None,))
    if set(shards) == {None}:
        order = (None,)  # a fused tensor for the whole merged layer (Phi-3's attn_qkv, ffn_up)
    if layer.tp_size != 1 or set(shards) != set(order) or len({code for code, _ in shards.values()}) != 1:
        return None
    code = shards[order[0]][0]
    gguf_rows = np.concatenate([shards[s][1] for s in order])  # a copy, off the mmap
    if gguf_rows.shape[0] != layer.out_features:
        return None
    vnni = torch.from_numpy(vnni_rows(gguf_rows, code)) if activation_bits else None
    # With the 16-bit batched kernel (AVX-512 VNNI or AVX2), the integer-activation layout serves
    # every row count (the few rows: quant_gemv_int8; more: quant_gemm_vnni16; or oneDNN where the
    # batched kernel is off), so the float kernels' layout would never be read.
    split = None if vnni is not None and gemm_vnni16_available() else torch.from_numpy(split_rows(gguf_rows, code))
    return QuantizedBlocks(split, code, layer.out_features, vnni, activation_bits or 16)
