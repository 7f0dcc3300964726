"""Tile shapes of the fused MoE GEMMs per shape and batch, tuned offline and kept in the repo.

`moe_configs/E=<experts>,I=<intermediate>,H=<hidden>,dtype=<dtype>.json` holds, for batches of
T tokens (the keys), the method ("grouped" or "gemv"), the rows per expert block (`block_m`,
shared by both grouped GEMMs: the pairs are aligned once) and each kernel's tiles; `benchmarks/tune_fused_moe.py` writes them on a GPU and
records which one. A batch takes the tuned entry of the nearest T. A shape without a file gets
`default_tiles`, chosen from the average number of pairs per expert: a few tokens over many
experts (about one pair each) take the GEMV path (fused_moe_gemv.py); small batches leave a few
rows per expert, so 16-row blocks waste the least; large ones fill 64-row blocks.

The tiles depend on the GPU only through its shared memory and SM count; the files record the
device they were tuned on, and the tiles serve any CUDA device (a shape tuned on an H100 runs
well enough on an H200; re-tune for other generations).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).parent / "moe_configs"


@dataclass(frozen=True, slots=True)
class GemmTiles:
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class MoETiles:
    block_m: int  # rows (token-expert pairs) of one expert per block (the grouped path)
    gate_up: GemmTiles
    down: GemmTiles
    # "grouped": align + grouped GEMMs (fused_moe.py); "gemv": per-pair / per-token GEMVs for a few
    # tokens (fused_moe_gemv.py; block_m and group_m unused).
    method: str = "grouped"

    def __post_init__(self) -> None:
        if self.method not in ("grouped", "gemv"):
            raise ValueError(f"MoE method {self.method!r} is not 'grouped' or 'gemv'")

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method, "block_m": self.block_m, "gate_up": asdict(self.gate_up),
            "down": asdict(self.down),
        }  # fmt: skip

    @staticmethod
    def from_json(entry: dict[str, Any]) -> MoETiles:
        return MoETiles(
            int(entry["block_m"]), GemmTiles(**entry["gate_up"]), GemmTiles(**entry["down"]),
            entry.get("method", "grouped"),
        )  # fmt: skip


def config_file_name(num_experts: int, inter: int, hidden: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},I={inter},H={hidden},dtype={str(dtype).removeprefix('torch.')}.json"


def moe_tiles(
    num_experts: int, inter: int, hidden: int, dtype: torch.dtype, num_tokens: int, top_k: int
) -> MoETiles:
    """The tiles for a batch of `num_tokens` tokens, `top_k` experts each, through E experts of
    [2I, H] / [H, I]."""
    table = _tuned_table(config_file_name(num_experts, inter, hidden, dtype))
    if table:
        nearest = min(table, key=lambda tokens: (abs(tokens - num_tokens), tokens))
        return table[nearest]
    return default_tiles(num_experts, dtype, num_tokens, top_k)


def default_tiles(num_experts: int, dtype: torch.dtype, num_tokens: int, top_k: int) -> MoETiles:
    """Tiles for a shape nobody tuned: sized by the average pairs per expert."""
    if num_tokens * top_k <= num_experts and num_tokens <= 8:
        # About one pair per expert: a weight read per pair, no tensor-core padding or align.
        gate_up = GemmTiles(block_n=4, block_k=512 if dtype != torch.float32 else 256, num_warps=4, num_stages=2)
        return MoETiles(16, gate_up, gate_up, "gemv")
    if dtype == torch.float32:  # 4-byte tiles: smaller, fewer stages (shared memory)
        tiles = GemmTiles(block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
        return MoETiles(16 if num_tokens * top_k <= 16 * num_experts else 32, tiles, tiles)
    pairs_per_expert = num_tokens * top_k / num_experts
    if pairs_per_expert <= 16:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoETiles(16, tiles, tiles)
    if pairs_per_expert <= 64:
        tiles = GemmTiles(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
        return MoETiles(32, tiles, tiles)
    tiles = GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return MoETiles(64, tiles, tiles)


@cache
def _tuned_table(file_name: str) -> dict[int, MoETiles]:
    path = CONFIG_DIR / file_name
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    try:
        return {int(tokens): MoETiles.from_json(entry) for tokens, entry in record["configs"].items()}
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: malformed MoE tile config ({err}); rerun benchmarks/tune_fused_moe.py") from err
