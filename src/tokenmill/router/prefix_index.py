"""Which replica recently served which prompt prefix: an approximate radix tree in hash form.

A prompt is cut into fixed-size chunks (characters of its text at the router, token ids of one KV
block inside a data-parallel server) and each chunk's hash is chained from its parent's, as the
engine's own prefix cache hashes its blocks: two prompts share the first k chained hashes exactly
when they share their first k chunks. The index maps each chained hash to the replicas that were
sent a prompt through it; the longest run of leading hashes a replica holds is how much of the
prompt it probably still has cached. It is approximate the way SGLang's router tree is: it records
what was routed, not what the replicas kept, and forgets the least recently used hashes past a cap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

# The chain's first parent: any fixed value that no chunk hash is likely to equal.
_ROOT = 0x9E3779B97F4A7C15


def chained_hashes(chunks: Iterable[Hashable]) -> list[int]:
    """hash(parent, chunk) for each chunk in order. Python's hash is salted per process: the
    hashes are only ever compared within the process that made them."""
    parent = _ROOT
    out = []
    for chunk in chunks:
        parent = hash((parent, chunk))
        out.append(parent)
    return out


def text_chunk_hashes(text: str, chunk_chars: int) -> list[int]:
    """The chained hashes of `text` cut into `chunk_chars`-character chunks; a last partial chunk
    counts too, so short prompts still have a key."""
    return chained_hashes(text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars))


def token_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full KV blocks (the engine caches only full blocks)."""
    num_full = len(token_ids) // block_size
    return chained_hashes(tuple(token_ids[i * block_size : (i + 1) * block_size]) for i in range(num_full))


class PrefixIndex:
    """Chained chunk hash -> the replicas sent a prompt through it, least recently used first."""

    def __init__(self, max_entries: int = 1 << 20) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._sizes: dict[str, int] = {}  # per replica: how many hashes it holds

    def __len__(self) -> int:
        return len(self._holders)

    def size(self, replica: str) -> int:
        """How many chunks the replica holds: a proxy for how much it caches (SGLang's tree size)."""
        return self._sizes.get(replica, 0)

    def match(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many leading chunks of the prompt it holds (0 for none)."""
        matched = dict.fromkeys(replicas, 0)
        live = set(matched)
        for depth, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            live &= holders
            if not live:
                break
            for replica in live:
                matched[replica] = depth + 1
        return matched

    def insert(self, hashes: Sequence[int], replica: str) -> None:
        """Records that the prompt went to `replica`; its chunks become the most recently used."""
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            if replica not in holders:
                holders.add(replica)
                self._sizes[replica] = self._sizes.get(replica, 0) + 1
        while len(self._holders) > self.max_entries:
            _, evicted = self._holders.popitem(last=False)
            for name in evicted:
                self._sizes[name] -= 1

    def remove_replica(self, replica: str) -> None:
        """Forgets everything routed to `replica` (it died: its cache is gone)."""
        if not self._sizes.pop(replica, 0):
            return
        empty = []
        for h, holders in self._holders.items():
            holders.discard(replica)
            if not holders:
                empty.append(h)
        for h in empty:
            del self._holders[h]
