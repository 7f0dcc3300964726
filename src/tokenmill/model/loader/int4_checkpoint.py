"""AWQ, GPTQ and compressed-tensors `pack-quantized` checkpoint tensors -> the canonical INT4 form
(layers/quantize_weights.QuantizedInt4).

All three pack eight 4-bit values into each int32 word, value i in bits 4i..4i+3, and store
W[n, k] = (q - zero) * scale with one scale and zero per (group of input columns, output row). They
differ in which axis is packed, in what order, and in how the zero is stored:

- AWQ "gemm" (AutoAWQ's WQLinear_GEMM, transformers' `version: gemm`): qweight int32 [K, N/8] and
  qzeros int32 [K/G, N/8] are packed along the output axis N, and word c's nibble i holds column
  8c + AWQ_PACK_ORDER[i] (an interleaving its CUDA kernel's dequantization wants); scales [K/G, N].
  The zero is stored as it is; K must be a multiple of the group size.
- GPTQ (AutoGPTQ / GPTQModel / optimum): qweight int32 [K/8, N] is packed along the input axis K in
  plain order (word r of column n holds k = 8r..8r+7); qzeros int32 [ceil(K/G), N/8] is packed along
  N in plain order; scales [ceil(K/G), N]; g_idx int32 [K] is the group of input column k, which
  act-order (`desc_act: true`) shuffles because it quantized the columns in another order. The
  original `checkpoint_format: gptq` stores zero - 1 in each nibble (so the symmetric zero 8 is
  stored 7); `gptq_v2` stores the zero itself.
- compressed-tensors `pack-quantized` (llm-compressor's W4A16): weight_packed int32 [N, K/8] is
  packed along K in plain order (word c of row n holds k = 8c..8c+7) and holds the signed value
  plus 8, so each nibble is q itself; weight_scale [N, G] (G = 1 per channel) in the model's dtype;
  weight_shape [2] the unpacked [N, K]. Asymmetric checkpoints add weight_zero_point int32
  [N/8, G], the signed zero plus 8 packed along N (word r of group g holds rows 8r..8r+7), so again
  the nibble is the zero; symmetric ones store no zero (it is 8). actorder "group" adds
  weight_g_idx int32 [K], GPTQ's g_idx by another name.

The loader calls `expected_*_shapes` with the layer's (local) N and K from the model config and
`check_packed_shapes` before unpacking, so a checkpoint that disagrees with its config is an error
naming the tensor. Unpacking reads values (a g_idx range check, the symmetric zeros): load time only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.layers.quantize_weights import (
    QuantizedInt4,
    check_g_idx,
    default_g_idx,
    num_int4_groups,
)

PACK_FACTOR = 8  # 4-bit values per int32 word
# AWQ's packing: nibble i of a word holds output column 8c + AWQ_PACK_ORDER[i] ...
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column 8c + j sits in nibble AWQ_NIBBLE_OF_COLUMN[j] (the inverse permutation).
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(j) for j in range(PACK_FACTOR))
SYMMETRIC_ZERO = 8


def _packed(n: int, what: str) -> int:
    if n % PACK_FACTOR:
        raise UnsupportedModelError(
            f"{what} ({n}) must be a multiple of {PACK_FACTOR} to pack eight 4-bit values into each int32"
        )
    return n // PACK_FACTOR


def expected_awq_shapes(n: int, k: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes of an AWQ "gemm" layer's tensors for a weight of `n` output and `k` input features."""
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise UnsupportedModelError(
            f"AWQ needs in_features ({k}) to be a multiple of group_size ({group_size})"
        )
    groups, words = k // group_size, _packed(n, "AWQ out_features")
    return {"qweight": (k, words), "qzeros": (groups, words), "scales": (groups, n)}


def expected_gptq_shapes(n: int, k: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a GPTQ layer's tensors for a weight of `n` output and `k` input features."""
    groups = num_int4_groups(k, group_size)
    return {
        "qweight": (_packed(k, "GPTQ in_features"), n),
        "qzeros": (groups, _packed(n, "GPTQ out_features")),
        "scales": (groups, n),
        "g_idx": (k,),
    }


def expected_pack_quantized_shapes(n: int, k: int, group_size: int, symmetric: bool) -> dict[str, tuple[int, ...]]:
    """The shapes of a compressed-tensors `pack-quantized` 4-bit layer's tensors for a weight of `n`
    output and `k` input features (weight_zero_point only when asymmetric; weight_g_idx, present with
    actorder "group", is listed for checking when it is there)."""
    groups = num_int4_groups(k, group_size)
    shapes = {
        "weight_packed": (n, _packed(k, "pack-quantized in_features")),
        "weight_scale": (n, groups),
        "weight_shape": (2,),
        "weight_g_idx": (k,),
    }
    if not symmetric:
        # Zero points are packed along the output rows (compressed-tensors' packed_dim=0).
        shapes["weight_zero_point"] = (_packed(n, "pack-quantized out_features (zero points)"), groups)
    return shapes


def check_packed_shapes(
    layer: str,
    tensors: Mapping[str, torch.Tensor | None],
    expected: Mapping[str, tuple[int, ...]],
    config: str,
) -> None:
    """Raise UnsupportedModelError naming the first tensor of `layer` whose shape is not the one
    `config` (e.g. "awq, group_size 128, [4096, 4096]") implies; None entries (an absent optional
    tensor such as GPTQ's g_idx) are skipped."""
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is not None and tuple(tensor.shape) != tuple(shape):
            raise UnsupportedModelError(
                f"checkpoint tensor {layer}.{name} has shape {list(tensor.shape)}, but {config} "
                f"needs {list(shape)}: the checkpoint disagrees with its quantization_config",
                param="model",
            )


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8], nibble i of each word last (an arithmetic shift then a mask
    reads the sign bits of negative words right)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _require_packed(
    layer: str, tensors: Mapping[str, torch.Tensor], scales: torch.Tensor, scales_name: str = "scales"
) -> None:
    if not scales.is_floating_point():
        raise UnsupportedModelError(
            f"checkpoint tensor {layer}.{scales_name} should be floating point (16-bit); got {scales.dtype}",
            param="model",
        )
    for name, tensor in tensors.items():
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise UnsupportedModelError(
                f"checkpoint tensor {layer}.{name} should be 2-D int32 (eight 4-bit values a word); got "
                f"{tensor.dtype} {list(tensor.shape)}",
                param="model",
            )


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [R, N/8] -> uint8 [R, N] in column order."""
    nibbles = _nibbles(words)
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=words.device)
    return nibbles.index_select(-1, order).flatten(-2)


def unpack_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    layer: str = "layer",
) -> QuantizedInt4:
    """An AWQ "gemm" layer (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]) in the
    canonical INT4 form; `layer` names it in errors."""
    _require_packed(layer, {"qweight": qweight, "qzeros": qzeros}, scales)
    k, n = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    group_size = k if group_size == -1 else group_size
    expected = expected_awq_shapes(n, k, group_size)
    check_packed_shapes(
        layer,
        {"qzeros": qzeros, "scales": scales},
        expected,
        f"awq group_size {group_size} with qweight {list(qweight.shape)}",
    )
    q = _awq_columns(qweight).t().contiguous()
    zeros = _awq_columns(qzeros).t().contiguous()
    return QuantizedInt4(
        q, scales.t().contiguous(), zeros, group_size, default_g_idx(k, group_size, qweight.device)
    )


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    sym: bool,
    zeros_offset: int,
    *,
    layer: str = "layer",
) -> QuantizedInt4:
    """A GPTQ layer (qweight int32 [K/8, N], qzeros int32 [G, N/8], scales [G, N], g_idx int32 [K] or
    None for k // group_size) in the canonical INT4 form. `zeros_offset` is 1 for checkpoint_format
    "gptq" (zeros stored minus one) and 0 for "gptq_v2". With `sym` every zero must come out 8: any
    other value means the checkpoint_format (or sym) in the config is wrong, and is an error."""
    if zeros_offset not in (0, 1):
        raise ValueError(f"zeros_offset is 1 (checkpoint_format 'gptq') or 0 ('gptq_v2'); got {zeros_offset}")
    _require_packed(layer, {"qweight": qweight, "qzeros": qzeros}, scales)
    k, n = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    num_groups = num_int4_groups(k, group_size)
    group_size = k if group_size == -1 else group_size
    config = f"gptq group_size {group_size} with qweight {list(qweight.shape)}"
    check_packed_shapes(
        layer,
        {"qzeros": qzeros, "scales": scales, "g_idx": g_idx},
        expected_gptq_shapes(n, k, group_size),
        config,
    )
    if g_idx is None:
        g_idx = default_g_idx(k, group_size, qweight.device)
    try:
        check_g_idx(g_idx, k, num_groups, f"{layer}.g_idx")
    except ValueError as err:
        raise UnsupportedModelError(f"checkpoint tensor {err}", param="model") from None
    # Packed along K: word r of column n holds k = 8r + i in nibble i.
    q = _nibbles(qweight).permute(1, 0, 2).reshape(n, k)
    # A v1 zero of 0 was stored as -1; masking after the +1 reads that nibble (15) back as 0.
    zeros = ((_nibbles(qzeros).flatten(-2).to(torch.int32) + zeros_offset) & 0xF).to(torch.uint8)
    if sym and bool((zeros != SYMMETRIC_ZERO).any()):
        found = sorted(set(zeros.flatten().tolist()))[:8]
        raise UnsupportedModelError(
            f"checkpoint tensor {layer}.qzeros of a sym=true GPTQ checkpoint should hold zero point "
            f"{SYMMETRIC_ZERO} everywhere (stored {SYMMETRIC_ZERO - zeros_offset} with this "
            f"checkpoint_format), but holds zero points {found}: is quantization_config's "
            "checkpoint_format ('gptq' stores zeros minus one, 'gptq_v2' as they are) or sym right?",
            param="model",
        )
    return QuantizedInt4(
        q.contiguous(), scales.t().contiguous(), zeros.t().contiguous(), group_size, g_idx.to(torch.int32)
    )


def unpack_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    *,
    weight_shape: torch.Tensor | None = None,
    layer: str = "layer",
) -> QuantizedInt4:
    """A compressed-tensors `pack-quantized` 4-bit layer (weight_packed int32 [N, K/8], weight_scale
    [N, G], weight_zero_point int32 [N/8, G] or None when symmetric, weight_g_idx int32 [K] or None
    for k // group_size) in the canonical INT4 form. `weight_shape`, if given, must be [N, K] of
    these tensors (the loader checks a tensor-parallel shard's against the whole layer instead)."""
    packed = {"weight_packed": weight_packed}
    if weight_zero_point is not None:
        packed["weight_zero_point"] = weight_zero_point
    _require_packed(layer, packed, weight_scale, "weight_scale")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * PACK_FACTOR
    num_groups = num_int4_groups(k, group_size)
    group_size = k if group_size == -1 else group_size
    check_packed_shapes(
        layer,
        {"weight_scale": weight_scale, "weight_zero_point": weight_zero_point, "weight_g_idx": g_idx,
         "weight_shape": weight_shape},
        expected_pack_quantized_shapes(n, k, group_size, symmetric=weight_zero_point is None),
        f"pack-quantized group_size {group_size} with weight_packed {list(weight_packed.shape)}",
    )  # fmt: skip
    if weight_shape is not None and weight_shape.tolist() != [n, k]:
        raise UnsupportedModelError(
            f"checkpoint tensor {layer}.weight_shape holds {weight_shape.tolist()}, but weight_packed "
            f"{list(weight_packed.shape)} holds a [{n}, {k}] weight (eight 4-bit values a word)",
            param="model",
        )
    if g_idx is None:
        g_idx = default_g_idx(k, group_size, weight_packed.device)
    try:
        check_g_idx(g_idx, k, num_groups, f"{layer}.weight_g_idx")
    except ValueError as err:
        raise UnsupportedModelError(f"checkpoint tensor {err}", param="model") from None
    # Packed along K: word c of row n holds k = 8c + i in nibble i; the stored value + 8 is q itself.
    q = _nibbles(weight_packed).reshape(n, k)
    if weight_zero_point is None:
        zeros = torch.full((n, num_groups), SYMMETRIC_ZERO, dtype=torch.uint8, device=weight_packed.device)
    else:
        # Packed along N: word r of group g holds rows 8r + i in nibble i ([N/8, G, 8] -> [N, G]).
        zeros = _nibbles(weight_zero_point).permute(0, 2, 1).reshape(n, num_groups)
    return QuantizedInt4(
        q.contiguous(), weight_scale.contiguous(), zeros.contiguous(), group_size, g_idx.to(torch.int32)
    )
