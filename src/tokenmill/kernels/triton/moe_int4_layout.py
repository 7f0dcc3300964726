"""How INT4 expert weights are packed for the fused MoE kernels (fused_moe.py, fused_moe_gemv.py).

Eight unsigned 4-bit weights per int32 word along K, as in int4_pack.py's dense layout: K is cut in
"packs" of 8 * CHUNK columns, and word p (0 <= p < CHUNK) of a pack holds, in nibble j (bits
4j..4j+3), the column j * CHUNK + p of that pack. A [rows, CHUNK] tile of words then unpacks,
nibble plane by nibble plane, into eight [rows, CHUNK] weight tiles that each multiply one
contiguous CHUNK-column slice of the activations: the GEMVs load every word once and never gather
(a plain "column 8j + i in nibble i of word j" layout needs a gather per weight, or a shuffle).

CHUNK is a function of the matrix's K and group size (`int4_chunk`), so it is never stored: the
packer and each launch derive the same one. It keeps a plane inside one group of scales, and a pack
inside one group or a whole number of groups inside a pack, so a plane's scale and zero are one per
row. Scales and zeros stay [E, N, K / group] in column order.
"""

from __future__ import annotations

import torch

INT4_PER_WORD = 8
_CHUNKS = (32, 16, 8, 4, 2, 1)  # 32: a pack of 256 columns, 128 bytes of words per row


def int4_chunk(columns: int, group_size: int) -> int:
    """Words per pack row for a matrix of `columns` (K) in groups of `group_size` (K for one group
    per row): the largest CHUNK whose pack divides K, whose planes lie in one group, and whose pack
    holds whole groups or lies in one. 1 always qualifies for the shapes the kernels accept (K and
    the group multiples of 8)."""
    if columns % INT4_PER_WORD or group_size % INT4_PER_WORD or columns % group_size:
        raise ValueError(
            f"INT4 experts need K and the group size multiples of 8, the group dividing K; got K {columns}, "
            f"group size {group_size}"
        )
    for chunk in _CHUNKS:
        pack = INT4_PER_WORD * chunk
        if columns % pack == 0 and group_size % chunk == 0 and (pack % group_size == 0 or group_size % pack == 0):
            return chunk
    raise AssertionError("unreachable: a chunk of 1 qualifies")


def pack_int4_experts(q: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """int32 words [E, N, K / 8] of the 4-bit codes q [E, N, K] (values 0..15) in the kernels'
    layout (module docstring); `group_size` None for one group per row."""
    experts, rows, columns = q.shape
    chunk = int4_chunk(columns, group_size or columns)
    planes = q.to(torch.int32).reshape(experts, rows, columns // (INT4_PER_WORD * chunk), INT4_PER_WORD, chunk)
    words = torch.zeros((experts, rows, columns // (INT4_PER_WORD * chunk), chunk), dtype=torch.int32, device=q.device)
    for j in range(INT4_PER_WORD):
        words |= planes[..., j, :] << (4 * j)  # the top nibble's shift wraps into the sign bit, as int32 packing does
    return words.reshape(experts, rows, columns // INT4_PER_WORD).contiguous()


def unpack_int4_experts(words: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """The codes q [E, N, K] (int32, 0..15) of `pack_int4_experts`' words [E, N, K / 8]."""
    experts, rows, num_words = words.shape
    columns = num_words * INT4_PER_WORD
    chunk = int4_chunk(columns, group_size or columns)
    packs = words.reshape(experts, rows, columns // (INT4_PER_WORD * chunk), 1, chunk)
    shifts = 4 * torch.arange(INT4_PER_WORD, device=words.device, dtype=torch.int32).view(1, 1, 1, -1, 1)
    return ((packs >> shifts) & 0xF).reshape(experts, rows, columns)
