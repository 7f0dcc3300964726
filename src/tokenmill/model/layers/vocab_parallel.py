"""The vocabulary split over tensor-parallel ranks: the embedding table and lm_head.

Rank r holds rows [r * rows, (r + 1) * rows) of the [vocab, hidden] tables, rows = ceil(vocab /
size); the last rank's tail past the vocabulary is padding (zeros, never looked up, its logits cut
off). A rank looks up only the ids it holds (zeros for the others) and an all-reduce sums the
rows; lm_head computes this rank's logits and an all-gather puts the vocabulary back together on
every rank (each samples from the same logits: parallel_state.broadcast_from_driver). With one
rank these are the plain table and a whole lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import all_gather_last_dim, all_reduce
from tokenmill.model.layers.linear import LinearBase, ShardId, _check_shape
from tokenmill.model.layers.linear_method import LinearMethod


@dataclass(frozen=True, slots=True)
class VocabShard:
    vocab_size: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def rows(self) -> int:
        """Rows of the table on every rank (padding included)."""
        return -(-self.vocab_size // self.tp_size)

    @property
    def start(self) -> int:
        return self.tp_rank * self.rows

    @property
    def num_valid(self) -> int:
        """This rank's rows that are real tokens."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    @torch.no_grad()
    def load_rows(self, table: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the whole checkpoint table `loaded` [vocab, hidden] into `table`."""
        _check_shape(loaded, (self.vocab_size, *table.shape[1:]))
        n = self.num_valid
        table[:n].copy_(loaded[self.start : self.start + n])
        table[n:].zero_()

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of the whole vocabulary's table for `input_ids` [T] -> [T, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, table)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        rows = F.embedding(local.masked_fill(outside, 0), table)
        rows.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(rows)


class ParallelLMHead(LinearBase):
    """lm_head over this rank's vocabulary rows; its output is the whole vocabulary's logits."""

    def __init__(
        self,
        hidden_size: int,
        shard: VocabShard,
        *,
        method: LinearMethod | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

        if isinstance(method, QuantizedLinearMethod):
            # lm_head stays 16-bit in every quantized model (QuantizationSpec); built so from the start,
            # since a vocabulary shard need not fit a quantized layout's blocks (500 rows, 8 per word).
            method = method.base
        super().__init__(
            hidden_size, shard.vocab_size, hidden_size, shard.rows, bias=False, method=method,
            tp_rank=shard.tp_rank, tp_size=shard.tp_size, device=device, dtype=dtype,
            shared_weight=shared_weight,
        )  # fmt: skip
        self.vocab_shard = shard

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if residual is not None:
            raise ValueError("lm_head takes no residual")
        local = self.method.apply(self, x, None, None, out_dtype)
        return all_gather_last_dim(local)[..., : self.vocab_shard.vocab_size]

    forward = __call__

    def _shard(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.vocab_shard
        _check_shape(loaded, (shard.vocab_size, *param.shape[1:]))
        n = shard.num_valid
        param[n:].zero_()  # padding rows: their logits are cut off, but keep them finite
        return param.narrow(0, 0, n), loaded.narrow(0, shard.start, n)
