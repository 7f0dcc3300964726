"""The CPU linear method over weights prepacked for oneDNN.

On the CPU, F.linear over a plain [out, in] float32 weight goes to MKL's sgemm, which is slow in
the middle of the decode batch range (a 3072x576 matmul at 16 rows took 1.96 ms against 0.46 ms
for the same weight prepacked; lm_head at 64 rows 55 ms against 41: best-of-7 timings of single
matmuls on the 2-core dev machine; the end-to-end A/B is in BENCHMARKS.md). oneDNN's linear takes a weight reordered once into its blocked
layout, the same size as the original, and works for any number of rows.

But each oneDNN call costs ~40 us more than MKL's on one thread, which a single-row matmul (one
request decoding) feels: a token's matmuls took 38.3 ms packed against 32.0 ms plain on one
thread. So a packed layer may keep its plain original beside it for single-row calls, while the
model's matmul weights total at most `keep_plain_bytes`; larger models give that up rather than
double their weight memory.

The packed weight replaces the layer's `weight` parameter (an opaque oneDNN tensor cannot be a
Parameter's data) as the layer's `packed_weight`; the kept original is its `plain_weight`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenmill.model.layers.linear import LinearBase
from tokenmill.model.layers.linear_method import LinearMethod, finish_product

logger = logging.getLogger(__name__)

# The row count oneDNN tunes the blocked layout for; the packed weight serves any row count.
_PACK_BATCH_HINT = 64
# Below this many bytes of matmul weights, keep plain copies beside the packed ones: SmolLM2-135M's
# are 428 MiB.
KEEP_PLAIN_WEIGHTS_BYTES = 1 << 30


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """float32 on a CPU build with oneDNN (bf16 packing only pays with AMX/AVX512-BF16; not tried)."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def is_packed(layer: LinearBase) -> bool:
    return getattr(layer, "packed_weight", None) is not None


class OneDNNLinearMethod(LinearMethod):
    def __init__(self, keep_plain_bytes: int = KEEP_PLAIN_WEIGHTS_BYTES) -> None:
        self.keep_plain_bytes = keep_plain_bytes
        self.keep_plain = True  # decided over all the layers in process_layers_after_loading

    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        # A shared weight (a tied lm_head's: the embedding table) counts for nothing: it stays anyway.
        matmul_bytes = sum(layer.weight.nbytes for layer in layers if not layer.weight_is_shared)
        self.keep_plain = matmul_bytes <= self.keep_plain_bytes
        super().process_layers_after_loading(layers)
        logger.info(
            "CPU matmul weights prepacked for oneDNN (%.0f MiB)%s",
            matmul_bytes / 2**20,
            "; plain copies kept for single-row steps" if self.keep_plain else "",
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        plain = layer.weight.detach().contiguous()
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(plain, _PACK_BATCH_HINT)
        # A shared weight's plain form is kept anyway (no copy): use it for single rows too.
        layer.plain_weight = plain if self.keep_plain or layer.weight_is_shared else None
        del layer._parameters["weight"]  # without a plain copy the original is freed

    def release_single_row_copy(self, layer: LinearBase) -> None:
        layer.plain_weight = None

    def release_float_copies(self, layer: LinearBase) -> None:
        layer.packed_weight = None
        if not layer.weight_is_shared:  # a tied lm_head's plain weight is the embedding table itself
            layer.plain_weight = None

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        plain = layer.plain_weight
        if plain is not None and x.shape[0] == 1:
            y = F.linear(x, plain, bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
        return finish_product(y, residual, out_dtype)
