"""Linear layers with methods: tensor-parallel shards (no communication) recombine to the unsharded
output, weight loaders put checkpoint tensors in the right rows/columns, and a method can be
wrapped on a loaded model without touching the model file."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    wrap_linear_methods,
)
from tokenmill.model.layers.linear_method import LinearMethod, WrappingLinearMethod

IN, OUT = 24, 36
TP_SIZES = (1, 2, 3, 4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x(rows: int = 5, features: int = IN) -> torch.Tensor:
    return torch.randn(rows, features, generator=_gen(7), dtype=torch.float64)


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _shards(cls, tp_size: int, *args, **kwargs) -> list[LinearBase]:
    return [cls(*args, tp_rank=r, tp_size=tp_size, dtype=torch.float64, **kwargs) for r in range(tp_size)]


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_column_parallel_shards_concatenate_to_the_whole(tp_size):
    if OUT % tp_size:
        pytest.skip("not divisible")
    weight, bias = _tensor(OUT, IN, seed=1), _tensor(OUT, seed=2)
    whole = ReplicatedLinear(IN, OUT, bias=True, dtype=torch.float64)
    whole.weight_loader("weight", weight)
    whole.weight_loader("bias", bias)
    shards = _shards(ColumnParallelLinear, tp_size, IN, OUT, bias=True)
    for shard in shards:
        shard.weight_loader("weight", weight)
        shard.weight_loader("bias", bias)
        assert shard.weight.shape == (OUT // tp_size, IN)
    x = _x()
    torch.testing.assert_close(torch.cat([s(x) for s in shards], dim=-1), whole(x))
    torch.testing.assert_close(whole(x), x @ weight.T + bias)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_row_parallel_partial_outputs_sum_to_the_whole(tp_size):
    if IN % tp_size:
        pytest.skip("not divisible")
    weight, bias = _tensor(OUT, IN, seed=3), _tensor(OUT, seed=4)
    shards = _shards(RowParallelLinear, tp_size, IN, OUT, bias=True)
    for shard in shards:
        shard.weight_loader("weight", weight)
        shard.weight_loader("bias", bias)
        assert shard.weight.shape == (OUT, IN // tp_size)
    x = _x()
    cols = IN // tp_size
    partials = [s(x[:, r * cols : (r + 1) * cols]) for r, s in enumerate(shards)]  # each rank's input slice
    torch.testing.assert_close(sum(partials), x @ weight.T + bias)  # the bias is added once (rank 0)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_merged_gate_up_shards_hold_their_slice_of_each_part(tp_size):
    inter = 12
    if inter % tp_size:
        pytest.skip("not divisible")
    gate, up = _tensor(inter, IN, seed=5), _tensor(inter, IN, seed=6)
    shards = _shards(MergedColumnParallelLinear, tp_size, IN, (inter, inter))
    for shard in shards:
        shard.weight_loader("weight", gate, 0)
        shard.weight_loader("weight", up, 1)
    x = _x()
    local = inter // tp_size
    outs = [s(x) for s in shards]  # each [rows, gate slice | up slice]
    torch.testing.assert_close(torch.cat([o[:, :local] for o in outs], dim=-1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[:, local:] for o in outs], dim=-1), x @ up.T)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_qkv_shards_split_heads_and_replicate_kv_heads_beyond_their_count(tp_size, num_kv_heads):
    num_heads, head_dim = 12, 4
    if num_heads % tp_size or (tp_size < num_kv_heads and num_kv_heads % tp_size):
        pytest.skip("not divisible")
    if tp_size >= num_kv_heads and tp_size % num_kv_heads:
        pytest.skip("KV heads cannot be replicated evenly")
    hidden = 16
    q = _tensor(num_heads * head_dim, hidden, seed=8)
    k = _tensor(num_kv_heads * head_dim, hidden, seed=9)
    v = _tensor(num_kv_heads * head_dim, hidden, seed=10)
    bias = {
        s: _tensor(t.shape[0], seed=11 + i) for i, (s, t) in enumerate(zip("qkv", (q, k, v), strict=True))
    }
    shards = _shards(QKVParallelLinear, tp_size, hidden, head_dim, num_heads, num_kv_heads, bias=True)
    for shard in shards:
        for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
            shard.weight_loader("weight", tensor, shard_id)
            shard.weight_loader("bias", bias[shard_id], shard_id)
    x = _x(3, hidden)
    full = {s: x @ t.T + bias[s] for s, t in zip("qkv", (q, k, v), strict=True)}
    q_rows = num_heads // tp_size * head_dim
    kv_heads_per_rank = max(1, num_kv_heads // tp_size)
    kv_rows = kv_heads_per_rank * head_dim
    outs = [s(x) for s in shards]
    torch.testing.assert_close(torch.cat([o[:, :q_rows] for o in outs], dim=-1), full["q"])
    replicas = max(1, tp_size // num_kv_heads)
    for rank, out in enumerate(outs):
        first_head = (rank // replicas) * kv_heads_per_rank
        cols = slice(first_head * head_dim, first_head * head_dim + kv_rows)
        torch.testing.assert_close(out[:, q_rows : q_rows + kv_rows], full["k"][:, cols])
        torch.testing.assert_close(out[:, q_rows + kv_rows :], full["v"][:, cols])
    if tp_size > num_kv_heads:  # replicated: ranks sharing a KV head hold the same rows
        torch.testing.assert_close(outs[0][:, q_rows:], outs[replicas - 1][:, q_rows:])


def test_loaders_name_what_was_wrong():
    layer = MergedColumnParallelLinear(IN, (12, 12))
    with pytest.raises(ValueError, match=r"shape \(13, 24\) does not match the model's \(12, 24\)"):
        layer.weight_loader("weight", torch.zeros(13, IN), 0)
    with pytest.raises(ValueError, match="unknown shard 2"):
        layer.weight_loader("weight", torch.zeros(12, IN), 2)
    with pytest.raises(ValueError, match="no such bias"):
        layer.weight_loader("bias", torch.zeros(12), 0)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 5"):
        ColumnParallelLinear(IN, OUT, tp_size=5)
    with pytest.raises(ValueError, match="not a multiple of the number of KV heads"):
        QKVParallelLinear(16, 4, 12, 4, tp_size=6)


class _AddDelta(WrappingLinearMethod):
    """A stand-in for a LoRA adapter: counts its calls and adds a fixed delta to every output."""

    def __init__(self, inner: LinearMethod, delta: float) -> None:
        super().__init__(inner)
        self.delta = delta
        self.calls = 0

    def apply(self, layer, x, bias=None, residual=None, out_dtype=None):
        self.calls += 1
        y = self.inner.apply(layer, x, bias, None, out_dtype) + self.delta
        return y if residual is None else residual.add_(y)


def test_a_wrapping_method_changes_a_loaded_model_without_touching_the_model_file(tiny_llama_dir):
    from tokenmill.attention.torch_ref import TorchReferenceBackend
    from tokenmill.config import ModelConfig
    from tokenmill.model.registry import load_model, resolve_model

    config = ModelConfig(model=str(tiny_llama_dir))
    resolved = resolve_model(config)
    arch = resolved.arch
    backend = TorchReferenceBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, 4)
    model = load_model(config, arch, "cpu", torch.float32, backend, resolved=resolved)
    hidden = torch.randn(2, arch.hidden_size, generator=_gen(0))
    before = model.compute_logits(hidden)
    wrapped: dict[str, _AddDelta] = {}

    def wrap(layer: LinearBase, method: LinearMethod) -> LinearMethod:
        wrapper = _AddDelta(method, 0.5 if layer is model.lm_head else 0.0)
        wrapped["lm_head" if layer is model.lm_head else str(len(wrapped))] = wrapper
        return wrapper

    wrap_linear_methods(model, wrap)
    assert len(wrapped) == 4 * arch.num_layers + 1  # qkv, o, gate_up, down per layer, and lm_head
    torch.testing.assert_close(model.compute_logits(hidden), before + 0.5)
    assert wrapped["lm_head"].calls == 1
    kv_caches = [torch.zeros(2, 4, 4, arch.num_kv_heads, arch.head_dim) for _ in range(arch.num_layers)]
    from tokenmill.attention.backend import AttentionMetadata

    starts, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=3, num_reqs=1, max_query_len=3, max_seq_len=3, query_start_loc=starts,
        seq_lens=lens, block_tables=torch.tensor([[0]], dtype=torch.int32),
        slot_mapping=torch.arange(3), query_start_loc_cpu=starts, seq_lens_cpu=lens, is_decode_only=False,
    )  # fmt: skip
    with torch.inference_mode():
        model(torch.tensor([5, 6, 7]), torch.arange(3), kv_caches, meta)
    layer_wrappers = [w for key, w in wrapped.items() if key != "lm_head"]
    assert all(w.calls == 1 for w in layer_wrappers)  # every projection of every layer, once
