"""A decode step's attention part per layer on one CUDA GPU: RoPE, the KV store and paged attention.

Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks). One CUDA
graph runs the attention part of 32 layers, each on its own qkv rows and its own KV cache (the
caches together larger than L2 at batch 64, as a model's are), replayed many times: microseconds
per layer, launch gaps included, the way the engine's decode graphs run it.

- unfused: the separate RoPE + KV-store launch (kernels/triton/elementwise.rope_and_store_kv), then the
  attention launch (TritonPagedBackend.forward);
- fused: TritonPagedBackend.forward_decode_with_rope, one launch (when the tree has it);
- then, fused only, sweeps of the split count, the run-time minimum KV per split, and the decode
  tile config, one dimension at a time from the defaults.

    PYTHONPATH=src python3 benchmarks/decode_layer_microbench.py [--quick] [--no-sweep]

Prints a table; writes decode_layer_microbench[-LABEL].json under $OUT when that is set.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.triton_paged import TritonPagedBackend
from tokenmill.bench.timing import graph_replay_ms
from tokenmill.config import KernelConfig
from tokenmill.kernels.triton import paged_attention as pa
from tokenmill.kernels.triton.elementwise import rope_and_store_kv
from tokenmill.model.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS = 32
MAX_MODEL_LEN = 4096
DTYPE = torch.bfloat16


class Layers:
    """Per-layer qkv rows and KV caches plus one step's metadata for `contexts` (tokens cached)."""

    def __init__(self, contexts: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch = len(contexts)
        seq_lens = [c + 1 for c in contexts]
        blocks = [-(-s // BLOCK) for s in seq_lens]
        num_blocks = sum(blocks) + 8
        order = torch.randperm(num_blocks, generator=gen)
        width = MAX_MODEL_LEN // BLOCK
        block_tables = torch.zeros(batch, width, dtype=torch.int32)
        slots, used = [], 0
        for r, n in enumerate(blocks):
            owned = order[used : used + n]
            used += n
            block_tables[r, :n] = owned.to(torch.int32)
            slots.append(int(owned[contexts[r] // BLOCK]) * BLOCK + contexts[r] % BLOCK)
        qsl = torch.arange(batch + 1, dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        self.meta = AttentionMetadata(
            num_actual_tokens=batch,
            num_reqs=batch,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc=qsl.cuda(),
            seq_lens=seq.cuda(),
            block_tables=block_tables.cuda(),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            is_decode_only=True,
        )
        self.positions = torch.tensor(contexts, dtype=torch.int64, device="cuda")
        self.caches = [
            torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        self.qkvs = [
            torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        rotary = RotaryEmbedding(HEAD_DIM, MAX_MODEL_LEN, 500000.0, None, device="cuda", dtype=DTYPE)
        self.cos, self.sin = rotary.cos_cache, rotary.sin_cache

    def step(self, backend: TritonPagedBackend, fused: bool) -> None:
        n = self.meta.num_reqs
        for qkv, cache in zip(self.qkvs, self.caches, strict=True):
            qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(n, HEADS + KV_HEADS, HEAD_DIM)
            v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(n, KV_HEADS, HEAD_DIM)
            if fused:
                backend.forward_decode_with_rope(
                    qk[:, :HEADS], qk[:, HEADS:], v, self.positions, self.cos, self.sin, cache, self.meta
                )
            else:
                rope_and_store_kv(
                    qk, HEADS, v, self.positions, self.cos, self.sin, cache, self.meta.slot_mapping
                )
                backend.forward(qk[:, :HEADS], qk[:, HEADS:], v, cache, self.meta, kv_already_stored=True)


def time_graph(fn: Callable[[], None], reps: int) -> float:
    """ms per call of fn, captured once as a CUDA graph and replayed `reps` times (median of 5)."""
    return graph_replay_ms(fn, reps=reps, rounds=5, warmup=2)


def measure(layers: Layers, fused: bool, reps: int, splits=None, min_kv=None, config=None) -> float:
    """us per layer."""
    saved_config = pa.decode_tile_config
    try:
        if config is not None:
            pa.decode_tile_config = lambda group_pad, head_dim_pad, num_reqs=0: config
        kernel = KernelConfig(min_kv_tokens_per_split=min_kv or 0)
        backend = TritonPagedBackend(
            HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK, num_kv_splits=splits, kernel=kernel
        )
        backend.prepare_for_capture(
            max_num_reqs=layers.meta.num_reqs, max_blocks_per_req=MAX_MODEL_LEN // BLOCK
        )
        return 1000 * time_graph(lambda: layers.step(backend, fused), reps) / LAYERS
    finally:
        pa.decode_tile_config = saved_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--label", default="")
    parser.add_argument("--batches", default="64", help="more decode batch sizes at 640-token contexts")
    args = parser.parse_args()
    reps = 20 if args.quick else 50
    has_fused = hasattr(TritonPagedBackend, "forward_decode_with_rope")
    print(f"device: {torch.cuda.get_device_name(0)}; fused path in this tree: {has_fused}")
    cases = {"b=1 ctx=640": [640], "b=1 ctx=4000": [4000]}
    cases.update({f"b={b} ctx=640": [640] * int(b) for b in args.batches.split(",")})
    rows = []
    for name, contexts in cases.items():
        layers = Layers(contexts)
        for fused in (False, True) if has_fused else (False,):
            us = measure(layers, fused, reps)
            rows.append({"case": name, "variant": "fused" if fused else "unfused", "us_per_layer": us})
            print(f"{name:14} {rows[-1]['variant']:40} {us:7.2f} us/layer", flush=True)
        if not has_fused or args.no_sweep or name not in ("b=1 ctx=640", "b=64 ctx=640"):
            continue
        default = pa.decode_tile_config(4, HEAD_DIM, len(contexts))
        variants: list[tuple[str, dict]] = []
        if name.startswith("b=1"):
            variants += [(f"splits={s}", {"splits": s}) for s in (8, 16)]
        for bn in (32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    for chunk in (8, 32) if name.startswith("b=1") else (8,):
                        config = pa.TileConfig(1, default.block_m, bn, warps, stages, chunk)
                        variants.append(
                            (f"n={bn} warps={warps} stages={stages} chunk={chunk}", {"config": config})
                        )
        for label, kwargs in variants:
            try:
                us = measure(layers, True, reps, **kwargs)
            except Exception as exc:  # a config that does not compile: say so and go on
                print(
                    f"{name:14} fused {label:34} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True
                )
                continue
            rows.append({"case": name, "variant": f"fused {label}", "us_per_layer": us})
            print(f"{name:14} {rows[-1]['variant']:40} {us:7.2f} us/layer", flush=True)
            if name.startswith("b=64"):
                us = measure(layers, False, reps, **kwargs)
                rows.append({"case": name, "variant": f"unfused {label}", "us_per_layer": us})
                print(f"{name:14} {rows[-1]['variant']:40} {us:7.2f} us/layer", flush=True)
        del layers
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT")
    if out_dir:
        suffix = f"-{args.label}" if args.label else ""
        with open(os.path.join(out_dir, f"decode_layer_microbench{suffix}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
