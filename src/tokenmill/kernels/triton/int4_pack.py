"""INT4 weights repacked once at load into the layout the W4A16 kernel (int4_kernel.py) reads.

The canonical form (what the AWQ / GPTQ unpackers hand over): `q` uint8 [N, K] with values 0..15,
`scales` 16-bit [N, G], `zeros` uint8 [N, G], `g_idx` int32 [K] (the group of input column k).
W[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]].

The kernel's layout, chosen so that one 4-byte load per thread feeds eight dequantized values that
land where the tensor cores want them without moving between threads:
- K is cut in "packs" of 8 * CHUNK columns. Word p (0 <= p < CHUNK) of a pack holds, in nibble j,
  the column j * CHUNK + p of that pack. A [BLOCK_N, CHUNK] tile of words therefore unpacks, nibble
  plane by nibble plane, into eight [BLOCK_N, CHUNK] weight tiles of the same shape and register
  layout, each multiplied with a contiguous CHUNK-column slice of x: no reshape, no shuffle.
- `packed` is out-major, int32 [N_pad, K_pad / 8]: each output row streams contiguously along K.
- `scale_zero` is group-major int32 [G_pad, N_pad], the scale's 16 bits with the zero point above
  them: a tile's BLOCK_N (scale, zero) pairs of one group are one coalesced read of 4 bytes each,
  the least that Triton's software pipeline copies asynchronously (smaller loads would stall each
  K step for a full memory round trip).
- Act-order checkpoints (g_idx not k // group_size): the columns are sorted by group once here,
  so groups are contiguous; `perm[k]` is the x column that sorted column k multiplies, gathered at
  run time.
- N is padded to a multiple of 128 (the widest tile) and K to a multiple of the pack, with zero
  scales, so the kernel loads weights without masks; x's padded columns are masked to zero.
"""

from __future__ import annotations

import dataclasses

import torch

PACK_CHUNK = 32  # columns per nibble plane: a group (32, 64, 128, ...) holds whole chunks
PACK_K = 8 * PACK_CHUNK  # columns per pack: 8 nibbles of a word
N_ALIGN = 128  # the widest BLOCK_N
COUNTER_ROWS = 64  # split-K runs up to this many rows (int4_configs.MAX_SPLIT_K_ROWS)
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Weights:
    """Kernel-ready INT4 weights of one [N, K] matrix (see the module docstring for the layout)."""

    packed: torch.Tensor  # int32 [n_padded, k_padded // 8]
    scale_zero: torch.Tensor  # int32 [num_groups_padded, n_padded]: scale bits | zero << 16
    scale_dtype: torch.dtype  # the scales' 16-bit float type
    perm: torch.Tensor | None  # int32 [k_padded]: x column of sorted column k (act-order only)
    tile_counters: torch.Tensor  # int32, zero between calls: split-K's arrival count per output tile
    n: int  # output features
    k: int  # input features
    group_size: int  # columns per scale group in sorted order; k_padded for per-channel scales

    @property
    def n_padded(self) -> int:
        return self.packed.shape[0]

    @property
    def k_padded(self) -> int:
        return self.packed.shape[1] * 8

    @property
    def act_order(self) -> bool:
        return self.perm is not None

    def nbytes(self) -> int:
        """Device bytes read per matmul: packed weights, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def scales(self) -> torch.Tensor:
        """[num_groups_padded, n_padded] in scale_dtype."""
        return (self.scale_zero & 0xFFFF).to(torch.int16).view(self.scale_dtype)

    def zeros(self) -> torch.Tensor:
        """[num_groups_padded, n_padded] uint8."""
        return (self.scale_zero >> 16).to(torch.uint8)


def prepare_int4_weights(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> Int4Weights:
    """Repack canonical INT4 weights (module docstring) for `int4_linear`, on their device.

    `group_size` >= K (or -1) means per-channel scales (G = 1). Otherwise G = ceil(K / group_size)
    and group_size must be a multiple of 32 that divides 256 or is a multiple of 256 (32, 64, 128,
    256, 512, ...): a group then holds whole nibble planes of a pack. `g_idx` None means the default
    k // group_size; an act-order g_idx must put exactly group_size columns in each group (the last
    may have fewer), as GPTQ's does.
    """
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise ValueError(f"INT4 q must be uint8 [N, K] holding 0..15, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if n == 0 or k == 0:
        raise ValueError(f"INT4 weights need N, K > 0, got [N, K] = [{n}, {k}]")
    per_channel = group_size == -1 or group_size >= k
    whole_planes = group_size > 0 and group_size % PACK_CHUNK == 0
    aligned = whole_planes and (PACK_K % group_size == 0 or group_size % PACK_K == 0)
    if not per_channel and not aligned:
        raise ValueError(
            f"INT4 group_size {group_size} (K = {k}) is not supported: use per-channel (-1 or >= K) or a "
            f"multiple of {PACK_CHUNK} that divides {PACK_K} or is a multiple of it "
            "(32, 64, 128, 256, 512, ...)"
        )
    num_groups = 1 if per_channel else -(-k // group_size)
    if tuple(scales.shape) != (n, num_groups) or scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"INT4 scales must be float16/bfloat16 [N, G] = [{n}, {num_groups}] for K = {k} and group_size "
            f"{group_size}, got {scales.dtype} {tuple(scales.shape)}"
        )
    if tuple(zeros.shape) != (n, num_groups) or zeros.dtype != torch.uint8:
        raise ValueError(
            f"INT4 zeros must be uint8 [N, G] = [{n}, {num_groups}], got {zeros.dtype} {tuple(zeros.shape)}"
        )
    if int(q.max()) > 15 or int(zeros.max()) > 15:
        raise ValueError("INT4 q and zeros must hold values 0..15 (one nibble each, unpacked)")
    device = q.device

    perm = None
    if g_idx is not None and not per_channel:
        perm = _act_order_permutation(g_idx, k, group_size, device)
    elif g_idx is not None and (g_idx.numel() != k or bool((g_idx.to(device) != 0).any())):
        raise ValueError(
            f"INT4 per-channel weights (K = {k}) need g_idx all zero or None, got a g_idx of {g_idx.numel()}"
        )
    if perm is not None:
        q = q.index_select(1, perm)

    n_padded = -(-n // N_ALIGN) * N_ALIGN
    k_padded = -(-k // PACK_K) * PACK_K
    if per_channel:
        group_size = k_padded  # one group covering every (padded) column
    groups_padded = -(-k_padded // group_size)
    q = torch.nn.functional.pad(q, (0, k_padded - k, 0, n_padded - n))
    # Padded groups and rows get scale 0 (all bits 0): their weights dequantize to exactly 0.
    scale_zero = torch.zeros((groups_padded, n_padded), dtype=torch.int32, device=device)
    scale_bits = scales.t().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    scale_zero[:num_groups, :n] = scale_bits | (zeros.t().to(torch.int32) << 16)
    if perm is not None:
        perm = torch.nn.functional.pad(perm.to(torch.int32), (0, k_padded - k)).contiguous()
    return Int4Weights(
        packed=pack_nibbles(q),
        scale_zero=scale_zero,
        scale_dtype=scales.dtype,
        perm=perm,
        tile_counters=torch.zeros(
            n_padded // _MIN_BLOCK * (COUNTER_ROWS // _MIN_BLOCK), dtype=torch.int32, device=device
        ),
        n=n,
        k=k,
        group_size=group_size,
    )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (K a multiple of PACK_K, values 0..15) -> int32 [N, K / 8] in the pair layout:
    plane j of a pack is its columns j * PACK_CHUNK .. + PACK_CHUNK; words 2c and 2c + 1 of a pack
    hold planes 0-3 and 4-7 of the plane's columns 2c and 2c + 1, plane 4 * s + i of column 2c + h
    in bits 4 * i + 16 * h of word 2c + s."""
    n, k = q.shape
    planes = q.reshape(n, k // PACK_K, 2, 4, PACK_CHUNK // 2, 2).to(torch.int64)  # [n, t, s, i, c, h]
    shifts = _nibble_shifts(q.device)
    words = (planes << shifts).sum(dim=(3, 5))  # [n, t, s, c] < 2**32: the nibbles don't overlap
    words = words.transpose(2, 3)  # [n, t, c, s]: word 2c + s
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as a signed int32
    return words.to(torch.int32).reshape(n, k // 8).contiguous()


def _nibble_shifts(device) -> torch.Tensor:
    """[4, 1, 2]: the bit offset of plane 4 * s + i of column 2c + h in word 2c + s (i, h)."""
    return (4 * torch.arange(4, device=device).view(4, 1) + 16 * torch.arange(2, device=device)).view(4, 1, 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: int32 [N, K / 8] -> uint8 [N, K]."""
    n, words = packed.shape
    w = packed.to(torch.int64).reshape(n, words // PACK_CHUNK, PACK_CHUNK // 2, 2)  # [n, t, c, s]
    w = w.transpose(2, 3)  # [n, t, s, c]
    shifts = _nibble_shifts(packed.device)
    planes = (w[:, :, :, None, :, None] >> shifts) & 0xF  # [n, t, s, i, c, h]
    return planes.to(torch.uint8).reshape(n, words * 8)


def _act_order_permutation(g_idx: torch.Tensor, k: int, group_size: int, device) -> torch.Tensor | None:
    """The x columns in group order (stable), or None when g_idx is the default k // group_size.
    Refuses a g_idx whose groups are not group_size columns each."""
    if g_idx.dim() != 1 or g_idx.numel() != k:
        raise ValueError(f"INT4 g_idx must hold one group per input column, [{k}], got {tuple(g_idx.shape)}")
    g_idx = g_idx.to(device=device, dtype=torch.int64)
    default = torch.arange(k, device=device) // group_size
    if torch.equal(g_idx, default):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], default):
        counts = torch.bincount(g_idx.clamp(min=0), minlength=-(-k // group_size)).tolist()
        raise ValueError(
            f"INT4 act-order g_idx must put {group_size} columns in each group of "
            f"0..{-(-k // group_size) - 1} "
            f"(the last may have fewer), got group sizes {counts[:8]}{'...' if len(counts) > 8 else ''}"
        )
    return perm
