"""Linear layers that own their weights: replicated, column-parallel, row-parallel, merged gate/up and QKV.

Each layer holds the weight of its tensor-parallel shard (`tp_rank` of `tp_size`, 0 of 1 by
default) and a `method` (layers/linear_method.py) that creates, loads, post-processes and applies
it. Sharding follows the usual split: a column-parallel layer keeps a slice of the output rows
(its outputs concatenate to the full one), a row-parallel layer a slice of the input columns (its
partial outputs sum to the full one; only rank 0 adds the bias). A row-parallel layer all-reduces its
output (distributed/parallel_state.py: nothing on one rank), so attention's o_proj and the MLP's
down_proj return the whole sum; column-parallel outputs stay sharded for the next layer.

A layer's weight loader takes a whole checkpoint tensor, checks its shape against the unsharded
one, and copies this rank's part into the right rows (merged layers: of the shard named by
`shard_id`, "q" / "k" / "v" or 0 / 1, or of every shard for a fused tensor) or columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed.parallel_state import all_reduce
from tokenmill.model.layers.linear_method import LinearMethod

ShardId = str | int | None


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """Where a quantized method's checkpoint tensor keeps the layer's output features, so a merged
    layer loads each part's slice: along `out_dim`, `out_per_index` output features per index (8 for
    nibbles packed along the output, 128 for 128-row scale blocks; None: the tensor is the same for
    every part). `per_part`: one entry per merged part, shape [parts, *the checkpoint tensor's]
    (per-tensor scales; GPTQ's g_idx, which the method then checks the parts agree on)."""

    out_dim: int | None = 0
    out_per_index: int = 1
    per_part: bool = False
    # Each merged part has its own ceil(rows / out_per_index) entries (128x128-block scales of parts
    # whose sizes are not multiples of 128, as small models have): the part's slice starts after the
    # earlier parts' entries.
    round_up_per_part: bool = False
    # Where the checkpoint tensor keeps the layer's input features (None: it has no such dimension,
    # e.g. per-channel scales), `in_per_index` of them per index (8 for nibbles packed along the
    # input, the group size for group scales): a row-parallel shard takes its columns' entries.
    in_dim: int | None = None
    in_per_index: int = 1


WEIGHT_LAYOUT = ParamLayout()


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class LinearBase(nn.Module):
    """`y = x @ W.T + b` for this rank's shard W [out_features, in_features] (local sizes)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        method: LinearMethod | None,
        tp_rank: int,
        tp_size: int,
        device,
        dtype: torch.dtype | None,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside the tensor-parallel size {tp_size}")
        self.input_size, self.output_size = input_size, output_size  # unsharded
        self.in_features, self.out_features = in_features, out_features  # this rank's shard
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Checkpoint tensors a quantized method registered beyond weight / bias (qweight, scales,
        # ...): their layouts, and which of them a checkpoint must hold (`checkpoint_params`).
        self.param_layouts: dict[str, ParamLayout] = {}
        self.checkpoint_params: tuple[str, ...] = ("weight",)
        self.method = method or LinearMethod()
        dtype = dtype or torch.float32
        # A weight shared with another module (a tied lm_head's: the embedding table) is used as it
        # is: methods neither free nor re-lay it out.
        self.weight_is_shared = shared_weight is not None
        if shared_weight is not None:
            if tuple(shared_weight.shape) != (out_features, in_features):
                raise ValueError(
                    f"shared weight shape {tuple(shared_weight.shape)} != ({out_features}, {in_features})"
                )
            self.weight = shared_weight
        else:
            self.method.create_weights(self, in_features, out_features, device=device, dtype=dtype)
        self.bias = (
            nn.Parameter(torch.empty(self._bias_rows(), device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        # The same tensor as a plain attribute: nn.Module resolves a parameter through __getattr__,
        # a cost the CPU decode path (several calls per layer per step) notices. Loads and folds write
        # into the parameter's storage, so the reference stays right.
        object.__setattr__(self, "_applied_bias", self.bias)
        object.__setattr__(self, "folded_input_scale", None)

    def _bias_rows(self) -> int:
        return self.out_features

    def register_checkpoint_param(
        self, name: str, tensor: torch.Tensor, layout: ParamLayout = WEIGHT_LAYOUT, *, required: bool = True
    ) -> None:
        """Register a quantized method's tensor `name` (uninitialized), loaded from the checkpoint
        tensor of that name by weight_loader with `layout`; `required`: a checkpoint must hold it."""
        setattr(self, name, nn.Parameter(tensor, requires_grad=False))
        if name != "weight":
            self.param_layouts[name] = layout
        if required and name not in self.checkpoint_params:
            self.checkpoint_params = (*self.checkpoint_params, name)

    def forget_checkpoint_params(self) -> None:
        """Drop every registered parameter but bias (a method replacing them with its own form, or
        re-creating them for another method), and their layouts."""
        for name in ("weight", *self.param_layouts):
            if name in self._parameters:
                del self._parameters[name]
            elif hasattr(self, name):
                delattr(self, name)
        self.param_layouts = {}
        self.checkpoint_params = ()

    # Called a few times per layer per step: nn.Module.__call__'s hook dispatch is skipped on purpose
    # (a wrapping LinearMethod, not a hook, is how behaviour is added to a linear layer).
    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.method.apply(self, x, self._applied_bias, residual, out_dtype)

    forward = __call__

    # -- loading ------------------------------------------------------------------------------------

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's part of the checkpoint tensor `loaded` (of shard `shard_id` for merged
        layers) into the parameter `param_name` ("weight" or "bias")."""
        param = getattr(self, param_name, None)
        if param is None:
            raise ValueError(f"no such {param_name}")
        layout = self.param_layouts.get(param_name)
        if layout is not None:
            target, source = self._shard_by_layout(param_name, param.data, loaded, shard_id, layout)
        else:
            target, source = self._shard(param_name, param.data, loaded, shard_id)
        self.method.load_weight(self, target, source)

    def _shard_by_layout(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId, layout: ParamLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized tensor's slice for `shard_id`, and under tensor parallelism this rank's part of
        the checkpoint tensor: its output rows' entries (column-parallel), its input columns' entries
        (row-parallel, along `layout.in_dim`)."""
        part = self._part_index(shard_id)
        loaded = self._input_columns_of(param_name, loaded, layout)
        if layout.per_part:
            index = 0 if part is None else part
            return param.narrow(0, index, 1), _as_shape(loaded, (1, *param.shape[1:]), param_name)
        if layout.out_dim is None:
            return param, _as_shape(loaded, tuple(param.shape), param_name)
        if part is None:
            if self.out_features != self.output_size:  # a column-parallel layer: this rank's rows
                loaded = self._output_chunk(param_name, loaded, layout, self.out_features, self.tp_rank)
            return param, _as_shape(loaded, tuple(param.shape), param_name)
        start, rows = self._part_rows(shard_id)
        per = layout.out_per_index
        chunk = self.part_shard(shard_id)[2]  # type: ignore[attr-defined] - merged layers only
        if layout.round_up_per_part:
            first = sum(-(-self._part_rows(s)[1] // per) for s in self.shard_ids[:part])
            expected = list(param.shape)
            expected[layout.out_dim] = -(-rows // per)
            target = param.narrow(layout.out_dim, first, expected[layout.out_dim])
            if self.tp_size > 1:
                loaded = self._output_chunk(param_name, loaded, layout, rows, chunk)
            return target, _as_shape(loaded, tuple(expected), param_name)
        if start % per or rows % per:
            raise ValueError(
                f"{param_name}: part {shard_id!r} (output rows {start}..{start + rows}) does not align with its "
                f"{per}-row blocks"
            )
        expected = list(param.shape)
        expected[layout.out_dim] = rows // per
        if self.tp_size > 1:
            loaded = self._output_chunk(param_name, loaded, layout, rows, chunk)
        return param.narrow(layout.out_dim, start // per, rows // per), _as_shape(loaded, tuple(expected), param_name)

    def _output_chunk(
        self, param_name: str, loaded: torch.Tensor, layout: ParamLayout, rows: int, chunk: int
    ) -> torch.Tensor:
        """Chunk `chunk` of `rows` output rows of a checkpoint tensor laid out as `layout`."""
        per, dim = layout.out_per_index, layout.out_dim
        assert dim is not None
        if rows % per:
            raise ValueError(
                f"{param_name}: a tensor-parallel shard of {rows} output rows does not align with its {per}-row "
                f"blocks; use a tensor_parallel_size whose shards are multiples of {per} rows"
            )
        n = rows // per
        if loaded.shape[dim] < (chunk + 1) * n:
            raise ValueError(f"{param_name} has shape {tuple(loaded.shape)}: too few rows for shard {chunk} of {n}")
        return loaded.narrow(dim, chunk * n, n)

    def _input_columns_of(self, param_name: str, loaded: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
        """A row-parallel layer's entries of a checkpoint tensor along its input dimension."""
        if layout.in_dim is None or self.in_features == self.input_size:
            return loaded
        per = layout.in_per_index
        if self.in_features % per:
            raise ValueError(
                f"{param_name}: a tensor-parallel shard of {self.in_features} input columns does not align with "
                f"its {per}-column groups; use a tensor_parallel_size whose shards are multiples of {per} columns"
            )
        n = self.in_features // per
        return loaded.narrow(layout.in_dim, self.tp_rank * n, n)

    def _part_index(self, shard_id: ShardId) -> int | None:
        """The index of merged part `shard_id`; None for a plain layer (shard_id None)."""
        if shard_id is None:
            return None
        raise ValueError(f"unknown shard {shard_id!r}: this layer is not merged")

    def _part_rows(self, shard_id: ShardId) -> tuple[int, int]:
        raise ValueError(f"unknown shard {shard_id!r}: this layer is not merged")

    def _shard(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slice of `param` to fill, the part of `loaded` that goes there)."""
        _check_shape(loaded, param.shape)
        return param, loaded

    def fold_input_scale(self, scale: torch.Tensor) -> None:
        """W <- W * scale along the input dimension, rounded once (the deferred RMSNorm's fold), as
        the layer's method does it (LinearMethod.fold_input_scale)."""
        if not self.method.folds_input_scale:
            raise ValueError(f"{type(self.method).__name__} cannot fold a scale into its weights")
        self.method.fold_input_scale(self, scale)
        # The layer's input now lacks this scale: what multiplies the same input beside the weight
        # (a LoRA adapter's A) must take it too.
        object.__setattr__(self, "folded_input_scale", scale)  # not a parameter of this layer


def _check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {tuple(expected)}")


def _as_shape(loaded: torch.Tensor, expected: tuple[int, ...], param_name: str) -> torch.Tensor:
    """`loaded` in `expected`'s shape when only unit dimensions differ (a per-tensor scale stored as
    [] or [1], a per-channel one as [N, 1] or [N]); else ValueError naming both shapes."""
    if tuple(loaded.shape) == expected:
        return loaded
    squeezed = tuple(d for d in loaded.shape if d != 1)
    if squeezed == tuple(d for d in expected if d != 1):
        return loaded.reshape(expected)
    raise ValueError(
        f"{param_name} has shape {tuple(loaded.shape)}, but the quantization config makes it {expected}"
    )


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (lm_head until it is vocab-parallel)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, input_size, output_size, bias=bias, method=method,
            tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype, shared_weight=shared_weight,
        )  # fmt: skip


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks: rank r holds rows [r * out, (r + 1) * out)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        out_features = _divide(output_size, tp_size, "output size")
        super().__init__(
            input_size, output_size, input_size, out_features, bias=bias, method=method,
            tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype,
        )  # fmt: skip

    def _shard(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shape(loaded, (self.output_size, *param.shape[1:]))
        rows = self.out_features
        return param, loaded.narrow(0, self.tp_rank * rows, rows)


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks; the partial outputs sum to the full one. The bias is
    whole on every rank and added by rank 0 only. `reduce_results=False` leaves the sum to the
    caller, which adds this rank's partial output to others' first and all-reduces once (a
    mixture-of-experts block: its routed experts' and its shared expert's partials)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        in_features = _divide(input_size, tp_size, "input size")
        super().__init__(
            input_size, output_size, in_features, output_size, bias=bias, method=method,
            tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype,
        )  # fmt: skip
        self.reduce_results = reduce_results

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if self.tp_size == 1:
            return self.method.apply(self, x, self._applied_bias, residual, out_dtype)
        # The bias and a residual epilogue's residual are added once, by rank 0, to the sum of the partials.
        first = self.tp_rank == 0
        partial = self.method.apply(
            self, x, self._applied_bias if first else None, residual if first else None, out_dtype
        )
        return all_reduce(partial) if self.reduce_results else partial

    forward = __call__

    def _shard(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if param_name == "bias":
            _check_shape(loaded, param.shape)
            return param, loaded
        _check_shape(loaded, (self.output_size, self.input_size))
        cols = self.in_features
        return param, loaded.narrow(1, self.tp_rank * cols, cols)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel layers over one input in one matmul (gate and up): each rank holds its
    slice of every part, parts in order. Shard ids are the parts' indices."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = False,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = tuple(output_sizes)
        local = [_divide(size, tp_size, f"output size of part {i}") for i, size in enumerate(output_sizes)]
        super().__init__(
            input_size, sum(output_sizes), input_size, sum(local), bias=bias, method=method,
            tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype,
        )  # fmt: skip
        self.shard_ids: tuple[ShardId, ...] = tuple(range(len(output_sizes)))
        # shard id -> (first local row, local rows, this rank's chunk index within the loaded part)
        offsets = [sum(local[:i]) for i in range(len(local))]
        self._shard_rows = {i: (offsets[i], local[i], tp_rank) for i in range(len(local))}
        self._shard_sizes: dict[ShardId, int] = dict(enumerate(self.output_sizes))

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """As LinearBase's; shard_id None = a checkpoint tensor holding every part, fused in order
        (Phi-3's qkv_proj and gate_up_proj), each part then sharded as if loaded alone."""
        if shard_id is not None:
            super().weight_loader(param_name, loaded, shard_id)
            return
        layout = self.param_layouts.get(param_name, WEIGHT_LAYOUT)  # weight, bias: rows along dim 0
        if layout.per_part or layout.out_dim is None:
            # One entry describing the whole fused tensor (a per-tensor scale, GPTQ's g_idx): every
            # part's, as the parts were one layer when they were quantized.
            for part_id in self.shard_ids:
                super().weight_loader(param_name, loaded, part_id)
            return
        per, dim = layout.out_per_index, layout.out_dim
        if any(size % per for size in self.output_sizes):
            raise ValueError(
                f"a fused tensor of parts {' + '.join(map(str, self.output_sizes))} rows, {per} rows an entry "
                f"along dim {dim}: each part must hold whole entries to be split"
            )
        sizes = [size // per for size in self.output_sizes]
        if loaded.dim() <= dim or loaded.shape[dim] != sum(sizes):
            unit = "rows" if (dim, per) == (0, 1) else f"entries along dim {dim}"
            found = loaded.shape[dim] if loaded.dim() > dim else 0
            raise ValueError(
                f"a fused tensor of shape {tuple(loaded.shape)} has {found} {unit}; expected the parts' "
                f"{' + '.join(map(str, sizes))} = {sum(sizes)}" + (f" ({per} rows an entry)" if per > 1 else "")
            )
        for part_id, part in zip(self.shard_ids, loaded.split(sizes, dim=dim), strict=True):
            super().weight_loader(param_name, part, part_id)

    def _part_index(self, shard_id: ShardId) -> int | None:
        if shard_id is None:
            return None
        if shard_id not in self._shard_rows:
            raise ValueError(f"unknown shard {shard_id!r}; this layer's shards: {list(self._shard_rows)}")
        return list(self.shard_ids).index(shard_id)

    def _part_rows(self, shard_id: ShardId) -> tuple[int, int]:
        start, rows, _ = self._shard_rows[shard_id]
        return start, rows

    def part_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        """Part `shard_id` on this rank: (first local row, local rows, which chunk of the part's
        unsharded rows it is; a replicated KV head's chunk is shared by several ranks)."""
        return self._shard_rows[shard_id]

    def _shard(
        self, param_name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if shard_id not in self._shard_rows:
            raise ValueError(f"unknown shard {shard_id!r}; this layer's shards: {list(self._shard_rows)}")
        _check_shape(loaded, (self._shard_sizes[shard_id], *param.shape[1:]))
        start, rows, chunk = self._shard_rows[shard_id]
        return param.narrow(0, start, rows), loaded.narrow(0, chunk * rows, rows)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads. With fewer KV heads than ranks each KV
    head is replicated on tp_size / num_kv_heads consecutive ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_heads = _divide(num_heads, tp_size, "number of attention heads")  # per rank
        if tp_size >= num_kv_heads:
            if tp_size % num_kv_heads:
                raise ValueError(
                    f"the tensor-parallel size {tp_size} is not a multiple of the number of KV heads "
                    f"({num_kv_heads}), which it must be to replicate them"
                )
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // num_kv_heads
        else:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        self.head_dim = head_dim
        q_rows, kv_rows = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # The parent splits each part by tp_size; give it the sizes whose split is this rank's.
        super().__init__(
            hidden_size, (q_rows * tp_size, kv_rows * tp_size, kv_rows * tp_size), bias=bias,
            method=method, tp_rank=tp_rank, tp_size=tp_size, device=device, dtype=dtype,
        )  # fmt: skip
        kv_size = num_kv_heads * head_dim
        self.output_sizes = (num_heads * head_dim, kv_size, kv_size)  # unsharded
        self.output_size = sum(self.output_sizes)
        kv_chunk = tp_rank // self.num_kv_head_replicas
        self.shard_ids = ("q", "k", "v")
        self._shard_rows = {
            "q": (0, q_rows, tp_rank),
            "k": (q_rows, kv_rows, kv_chunk),
            "v": (q_rows + kv_rows, kv_rows, kv_chunk),
        }
        self._shard_sizes = dict(zip(self.shard_ids, self.output_sizes, strict=True))


def bind_hot_path(module: nn.Module, **refs: nn.Module | torch.Tensor | None) -> None:
    """Also keep `refs` (submodules, parameters) as plain attributes `_<name>` of `module`. nn.Module
    finds submodules and parameters through its Python __getattr__, a cost the CPU decode step
    notices at ~10 lookups per layer; plain attributes skip it. Only for objects that stay in place
    (weights are loaded and folded into their storage; behaviour changes by swapping linear methods,
    not modules)."""
    for name, ref in refs.items():
        object.__setattr__(module, f"_{name}", ref)


def linear_layers(model: nn.Module) -> Iterator[LinearBase]:
    return (module for module in model.modules() if isinstance(module, LinearBase))


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each linear layer's method put the loaded weights in the form it multiplies, once per
    method over all the layers it serves."""
    by_method: dict[int, tuple[LinearMethod, list[LinearBase]]] = {}
    for layer in linear_layers(model):
        by_method.setdefault(id(layer.method), (layer.method, []))[1].append(layer)
    for method, layers in by_method.values():
        method.process_layers_after_loading(layers)


def use_linear_method(model: nn.Module, method: LinearMethod) -> None:
    """Give every linear layer of a loaded model (with plainly loaded weights) `method`, and let it
    process the weights."""
    for layer in linear_layers(model):
        layer.method = method
    process_weights_after_loading(model)


def wrap_linear_methods(model: nn.Module, wrap: Callable[[LinearBase, LinearMethod], LinearMethod]) -> None:
    """Replace each linear layer's method by `wrap(layer, method)` (e.g. a WrappingLinearMethod: a
    LoRA adapter, a counter); the weights are already processed and stay as they are."""
    for layer in linear_layers(model):
        layer.method = wrap(layer, layer.method)
