"""KV cache groups: which layers share a block table, and how one pool of blocks holds them all.

Layers of one attention type (full attention, or one sliding-window width) need the same blocks
for the same tokens, so they share a block table: a group. A sliding group can free the blocks
that slid out of its window while a full group keeps every block, so the two cannot share a
table. Following vLLM's hybrid KV cache manager, every group has the same number of layers G,
and the pool's memory is G layer tensors `[2, num_blocks, block_size, kv_heads, head_dim]`: a
block id means "slot b of all G tensors", the block belongs to exactly one group at a time, and
layer j of every group keeps its K/V in tensor j. One pool, one free list, one prefix cache; a
block costs G layers' worth of bytes wherever it is used.

G is the layer count of the smallest attention type (vLLM's choice), or that of the largest when
the types are within 25 % of each other (one padded group is cheaper than a third group). A type
whose layer count is not a multiple of G has a last group of fewer layers: the tensors it leaves
unused are padding, paid only by the blocks of that group.

A model without sliding layers has one group holding every layer (G = num_layers): exactly the
one-tensor-per-layer cache with one block table of a model without groups. So does a model whose
every layer slides with the same window (Mistral): one sliding group. Gemma 2 / gpt-oss
(alternating) have two groups of num_layers / 2 layers; Gemma 3 (5 sliding : 1 full) has one
full group and five or six sliding ones.

This module is torch-free: the scheduler (core/) and the model runner (worker/) both build the
same plan from the model's per-layer windows.
"""

from __future__ import annotations

from dataclasses import dataclass

# When the largest attention type has fewer than this times the layers of the smallest, G is the
# largest count (the smaller types' groups are padded) instead of the smallest (more groups).
_PAD_INSTEAD_OF_SPLIT_RATIO = 1.25


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    sliding_window: int | None  # the layers' window in tokens; None = full attention
    layers: tuple[int, ...]  # model layer indices, ascending; layers[j] keeps its K/V in tensor j

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """The plan: the groups (full ones first), the number of physical tensors, and per layer
    which group's block table and which tensor it uses."""

    groups: tuple[KVCacheGroup, ...]
    num_tensors: int  # G: the pool's layer tensors; a block spans all of them
    layer_group: tuple[int, ...]  # per model layer: its group's index
    layer_tensor: tuple[int, ...]  # per model layer: the physical tensor holding its K/V

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def has_sliding(self) -> bool:
        return any(group.is_sliding for group in self.groups)

    def sliding_windows(self) -> list[int | None]:
        """Per group, its window (None for a full group)."""
        return [group.sliding_window for group in self.groups]

    def blocks_for_one_sequence(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens ever holds at once, computed in chunks
        of at most `max_chunk` tokens (plus the null block that sliding groups point at)."""
        total = 0
        for group in self.groups:
            full = -(-num_tokens // block_size)
            if group.sliding_window is None:
                total += full
            else:
                total += min(full, max_live_sliding_blocks(group.sliding_window, block_size, max_chunk))
        return total + (1 if self.has_sliding else 0)

    def capacity_tokens(self, num_blocks: int, block_size: int, max_chunk: int, max_model_len: int) -> int:
        """The longest sequence one request alone can reach in a pool of `num_blocks` blocks (see
        blocks_for_one_sequence). Without sliding groups, num_blocks * block_size, as ever; with
        them, at most max_model_len (an all-sliding model's need stops growing at its window)."""
        if not self.has_sliding:
            return num_blocks * block_size
        low, high = 0, max_model_len  # the answer lies in [low, high]
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_for_one_sequence(mid, block_size, max_chunk) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def describe(self) -> str:
        """One line for the log, e.g. '2 KV cache groups of 4 layers: full [1, 3, 5, 7], window 512 [...]'."""
        parts = [
            f"{'full' if g.sliding_window is None else f'window {g.sliding_window}'} {list(g.layers)}"
            for g in self.groups
        ]
        return f"{self.num_groups} KV cache group(s) of {self.num_tensors} layers: " + ", ".join(parts)


def max_live_sliding_blocks(window: int, block_size: int, num_new_tokens: int) -> int:
    """The most blocks a sliding group's table holds live in a step computing `num_new_tokens`
    tokens (with the blocks wholly before the window of the step's first query freed): the
    window behind the first query (window - 1 keys), the new tokens, and one block of alignment."""
    return -(-(window - 1 + num_new_tokens) // block_size) + 1


def plan_kv_cache_groups(
    num_layers: int,
    sliding_windows: tuple[int | None, ...] | list[int | None],
    max_model_len: int | None = None,
) -> KVCacheGroups:
    """Group `num_layers` layers by their sliding window (`sliding_windows[i]` for layer i, None =
    full; empty = every layer full). A window of at least `max_model_len` tokens never slides
    anything out, so its layers count as full ones here (the attention still gets the window)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    windows = list(sliding_windows) if sliding_windows else [None] * num_layers
    if len(windows) != num_layers:
        raise ValueError(
            f"sliding_windows has {len(windows)} entries but the model has {num_layers} layers; "
            "give one per layer (None for full attention) or none at all"
        )
    for i, window in enumerate(windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {i} has sliding window {window}; a window must be >= 1 token")
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]

    # Attention types in a fixed order: full first, then windows ascending.
    by_type: dict[int | None, list[int]] = {}
    for window in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        by_type[window] = [i for i, w in enumerate(windows) if w == window]
    counts = [len(layers) for layers in by_type.values()]
    group_size = min(counts)
    if max(counts) < _PAD_INSTEAD_OF_SPLIT_RATIO * min(counts):
        group_size = max(counts)

    groups: list[KVCacheGroup] = []
    layer_group = [0] * num_layers
    layer_tensor = [0] * num_layers
    for window, layers in by_type.items():
        for start in range(0, len(layers), group_size):
            members = tuple(layers[start : start + group_size])
            for tensor, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_tensor[layer] = tensor
            groups.append(KVCacheGroup(window, members))
    return KVCacheGroups(tuple(groups), group_size, tuple(layer_group), tuple(layer_tensor))
