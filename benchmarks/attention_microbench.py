"""Paged-attention microbenchmark on one CUDA GPU: Triton backend vs the torch reference.

Decode: bytes of K/V read per step / time, next to the measured device-to-device copy bandwidth
(bytes read + written), for each split-KV count and for the planner's own choice. Each timing
replays a CUDA graph of several forwards over distinct caches (together larger than L2, the way a
model's layers each read their own cache), so it measures HBM traffic, not launch gaps or L2.
Prefill: a mixed batch's attention FLOP/s, for scale.

    PYTHONPATH=src python3 benchmarks/attention_microbench.py [--quick]

Prints a table; writes attention_microbench.json under $OUT when that is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable

import torch
import triton

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.triton_paged import MAX_KV_SPLITS, TritonPagedBackend, choose_num_kv_splits
from tokenmill.bench.paged_batch import scattered_paged_batch
from tokenmill.bench.timing import capture_graph, cuda_ms
from tokenmill.kernels.triton.paged_attention import TileConfig, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 * 2**20  # distinct caches per graph add up to at least this much


def time_events(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn over reps, timed with CUDA events."""
    return cuda_ms(fn, rounds=reps, warmup=warmup)


def copy_bandwidth_gbs() -> float:
    src = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_events(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def make_decode_batch(contexts: list[int], seed: int) -> tuple[AttentionMetadata, int]:
    """Metadata for one decode step with scattered blocks; returns it and the pool's block count."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in contexts]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(blocks):
        owned = order[used : used + n]
        used += n
        block_tables[r, :n] = owned.to(torch.int32)
        pos = contexts[r]
        slots.append(int(owned[pos // BLOCK]) * BLOCK + pos % BLOCK)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=len(seq_lens),
        num_reqs=len(seq_lens),
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
    return meta, num_blocks


def decode_inputs(contexts: list[int]) -> tuple[AttentionMetadata, list[torch.Tensor], int]:
    """A decode batch's metadata, enough distinct caches that together they exceed L2, and the
    bytes of K/V one forward reads."""
    meta, num_blocks = make_decode_batch(contexts, seed=len(contexts))
    cache_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = max(1, math.ceil(L2_FLUSH_BYTES / cache_bytes))
    caches = [
        torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        for _ in range(copies)
    ]
    kv_bytes = sum(s * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize for s in meta.seq_lens_cpu.tolist())
    return meta, caches, kv_bytes


def graph_time_per_forward(
    forward: Callable[[torch.Tensor], torch.Tensor], caches: list[torch.Tensor], reps: int
) -> float:
    """ms per forward: one graph runs forward over every cache, replayed `reps` times."""

    def every_cache() -> None:
        for cache in caches:
            forward(cache)

    return time_events(capture_graph(every_cache).replay, reps) / len(caches)


def bench_decode(name: str, contexts: list[int], copy_gbs: float, num_sms: int, reps: int) -> list[dict]:
    meta, caches, kv_bytes = decode_inputs(contexts)
    batch = len(contexts)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size()
    max_blocks = meta.block_tables.shape[1]
    planned = choose_num_kv_splits(batch, KV_HEADS, max_blocks * BLOCK, num_sms)
    rows = []
    variants: list[tuple[str, int | None]] = [("auto", None)] + [
        (f"splits={s}", s) for s in (1, 2, 4, 8, 16, 32, 64)
    ]
    for label, splits in variants:
        if splits is not None and splits > MAX_KV_SPLITS:
            continue
        backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK, num_kv_splits=splits)
        backend.prepare_for_capture(max_num_reqs=batch, max_blocks_per_req=max_blocks)
        ms = graph_time_per_forward(lambda cache, b=backend: b.forward(q, k, v, cache, meta), caches, reps)
        rows.append(
            {
                "case": name,
                "impl": f"triton {label}" + (f" ({planned})" if splits is None else ""),
                "us": ms * 1e3,
                "gbs": io_bytes / ms / 1e6,
                "of_copy_bw": io_bytes / ms / 1e6 / copy_gbs,
            }
        )
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    reference = TorchReferenceBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    ms = time_events(lambda: reference.forward(q, k, v, caches[0], meta), reps=max(3, reps // 4))
    rows.append(
        {"case": name, "impl": "torch_ref (eager)", "us": ms * 1e3, "gbs": io_bytes / ms / 1e6,
         "of_copy_bw": io_bytes / ms / 1e6 / copy_gbs}
    )  # fmt: skip
    caches.clear()
    torch.cuda.empty_cache()
    return rows


def _prefill_case(
    query_lens: list[int], context_lens: list[int]
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Metadata, cache, q/k/v and the attention FLOPs of one mixed batch."""
    meta, num_blocks = scattered_paged_batch(query_lens, context_lens, BLOCK, seed=None)
    n = sum(query_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    visible = sum(sum(c + j + 1 for j in range(ql)) for c, ql in zip(context_lens, query_lens, strict=True))
    flops = 4 * visible * HEADS * HEAD_DIM
    return meta, cache, q, k, v, flops


def bench_prefill(name: str, query_lens: list[int], context_lens: list[int], reps: int) -> list[dict]:
    """Mixed-batch attention FLOP/s (QK^T and PV over the visible keys), eager."""
    meta, cache, q, k, v, flops = _prefill_case(query_lens, context_lens)
    backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    rows = []
    ms = time_events(lambda: backend.forward(q, k, v, cache, meta), reps)
    rows.append({"case": name, "impl": "triton", "us": ms * 1e3, "tflops": flops / ms / 1e9})
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    reference = TorchReferenceBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    ms = time_events(lambda: reference.forward(q, k, v, cache, meta), max(3, reps // 4))
    rows.append({"case": name, "impl": "torch_ref (eager)", "us": ms * 1e3, "tflops": flops / ms / 1e9})
    return rows


def sweep_decode_tiles(copy_gbs: float, reps: int) -> None:
    """Decode kernel alone over tile sizes / warps / pipeline depth: fraction of copy bandwidth."""
    gen = torch.Generator().manual_seed(0)
    cases = {
        "b=1 ctx=32768": ([32767], (32, 64)),
        "b=8 ctx=4096": ([4095] * 8, (4, 8)),
        "b=64 ctx~U": (torch.randint(1, 4096, (64,), generator=gen).tolist(), (1, 4)),
        "b=64 ctx=4096": ([4095] * 64, (1,)),
        # The offline throughput benchmark's decode steps: 512-token prompts, 256 new tokens.
        "b=64 ctx~U(512,768)": (torch.randint(512, 768, (64,), generator=gen).tolist(), (1, 2, 4)),
        "b=256 ctx~U(512,768)": (torch.randint(512, 768, (256,), generator=gen).tolist(), (1, 2)),
    }
    configs = [
        TileConfig(block_q=1, block_m=16, block_n=n, num_warps=w, num_stages=st)
        for n in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3, 4)
    ]
    header = "config (n/warps/stages)"
    columns = [f"{name} S={s}" for name, (_, splits) in cases.items() for s in splits]
    print(f"\n{header:24} " + " ".join(f"{c:>18}" for c in columns))
    prepared = []
    for contexts, splits_list in cases.values():
        meta, caches, kv_bytes = decode_inputs(contexts)
        q = torch.randn(len(contexts), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        for splits in splits_list:
            partial_out = torch.empty(len(contexts), HEADS, splits, HEAD_DIM, device="cuda")
            partial_lse = torch.empty(len(contexts), HEADS, splits, device="cuda")
            prepared.append((meta, caches, q, kv_bytes, splits, partial_out, partial_lse))
    for config in configs:
        cells = []
        for meta, caches, q, kv_bytes, splits, partial_out, partial_lse in prepared:
            out = torch.empty_like(q)

            def forward(
                cache, meta=meta, q=q, out=out, splits=splits, po=partial_out, pl=partial_lse, config=config
            ):
                paged_attention(
                    out, q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    num_reqs=meta.num_reqs, max_query_len=1, decode_only=True, scale=HEAD_DIM**-0.5,
                    num_kv_splits=splits, partial_out=po, partial_lse=pl, decode_config=config,
                )  # fmt: skip
                return out

            ms = graph_time_per_forward(forward, caches, reps)
            cells.append(kv_bytes / ms / 1e6 / copy_gbs)
        label = f"{config.block_n}/{config.num_warps}/{config.num_stages}"
        print(f"{label:24} " + " ".join(f"{c:18.2f}" for c in cells), flush=True)


def sweep_split_minimum(copy_gbs: float, num_sms: int, reps: int) -> None:
    """The engine's decode launch (default tiles, the split count CUDA graphs fix for a
    4096-token context limit, merge inside the launch) over the run-time minimum of KV tokens a
    split gets (`min_kv_per_split`; 0 = every planned split): fraction of copy bandwidth."""
    gen = torch.Generator().manual_seed(1)
    cases = {
        "b=1 ctx=640": [639],
        "b=1 ctx=4096": [4095],
        "b=8 ctx=4096": [4095] * 8,
        "b=16 ctx~U(512,768)": torch.randint(512, 768, (16,), generator=gen).tolist(),
        "b=64 ctx~U(512,768)": torch.randint(512, 768, (64,), generator=gen).tolist(),
        "b=64 ctx~U(1,4096)": torch.randint(1, 4096, (64,), generator=gen).tolist(),
        "b=64 ctx=4096": [4095] * 64,
        "b=256 ctx~U(512,768)": torch.randint(512, 768, (256,), generator=gen).tolist(),
    }
    minimums = (0, 256, 512, 1024, 2048)
    print(f"\n{'case (graph splits)':28} " + " ".join(f"{f'min {m}':>15}" for m in minimums))
    for name, contexts in cases.items():
        planned = choose_num_kv_splits(len(contexts), KV_HEADS, 4096, num_sms)
        # Also twice and four times the planned splits: with a minimum, short contexts still
        # take few of them while long ones spread wider.
        for splits in (planned, 2 * planned, 4 * planned) if len(contexts) >= 16 else (planned,):
            cells = _split_minimum_row(contexts, splits, minimums, copy_gbs, reps)
            print(f"{f'{name} (S={splits})':28} " + " ".join(f"{c:>15}" for c in cells), flush=True)


def _split_minimum_row(
    contexts: list[int], splits: int, minimums: tuple[int, ...], copy_gbs: float, reps: int
) -> list[str]:
    meta, caches, kv_bytes = decode_inputs(contexts)
    batch = len(contexts)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    partial_out = torch.empty(batch, HEADS, splits, HEAD_DIM, device="cuda")
    partial_lse = torch.empty(batch, HEADS, splits, device="cuda")
    counters = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device="cuda") if splits > 1 else None
    cells = []
    for minimum in minimums:

        def forward(cache, minimum=minimum):
            paged_attention(
                out, q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                num_reqs=meta.num_reqs, max_query_len=1, decode_only=True, scale=HEAD_DIM**-0.5,
                num_kv_splits=splits, partial_out=partial_out, partial_lse=partial_lse,
                split_counters=counters, min_kv_per_split=minimum, all_decode=True,
            )  # fmt: skip
            return out

        ms = graph_time_per_forward(forward, caches, reps)
        cells.append(f"{kv_bytes / ms / 1e6 / copy_gbs:.2f} ({ms * 1e3:.1f} us)")
    return cells


def sweep_prefill_tiles(reps: int) -> None:
    """Prefill flavour alone (4 x 2048 new tokens on 0/0/2048/2048 cached) over a few tile configs."""
    query_lens, context_lens = [2048] * 4, [0, 0, 2048, 2048]
    meta, cache, q, k, v, flops = _prefill_case(query_lens, context_lens)
    TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK).forward(q, k, v, cache, meta)
    out = torch.empty_like(q)
    print(f"\n{'prefill config (m/n/warps/stages)':36} {'us':>10} {'TFLOP/s':>8}")
    for m, n, w, st in [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 32, 4, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 2),
    ]:
        config = TileConfig(block_q=m // 4, block_m=m, block_n=n, num_warps=w, num_stages=st)

        def forward(config=config):
            paged_attention(
                out, q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                num_reqs=meta.num_reqs, max_query_len=meta.max_query_len, decode_only=False,
                scale=HEAD_DIM**-0.5, prefill_config=config,
            )  # fmt: skip

        ms = time_events(forward, reps)
        print(f"{f'{m}/{n}/{w}/{st}':36} {ms * 1e3:10.1f} {flops / ms / 1e9:8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument("--sweep", action="store_true", help="only sweep the decode kernel's tile configs")
    parser.add_argument(
        "--sweep-split-minimum",
        action="store_true",
        help="only sweep the run-time minimum of KV tokens per split",
    )
    args = parser.parse_args()
    reps = 10 if args.quick else 30
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {props.name}, {props.multi_processor_count} SMs, triton {triton.__version__}")
    print(f"device-to-device copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    if args.sweep_split_minimum:
        sweep_split_minimum(copy_gbs, props.multi_processor_count, reps)
        return
    if args.sweep:
        sweep_decode_tiles(copy_gbs, reps)
        sweep_prefill_tiles(reps)
        return
    gen = torch.Generator().manual_seed(0)
    decode_cases = {
        "decode b=1 ctx=512": [511],
        "decode b=1 ctx=4096": [4095],
        "decode b=1 ctx=32768": [32767],
        "decode b=8 ctx=4096": [4095] * 8,
        "decode b=64 ctx=4096": [4095] * 64,
        "decode b=64 ctx~U(1,4096)": torch.randint(1, 4096, (64,), generator=gen).tolist(),
        "decode b=32 ctx=768": [767] * 32,
        "decode b=256 ctx=1024": [1023] * 256,
    }
    if args.quick:
        decode_cases = {k: decode_cases[k] for k in list(decode_cases)[1:5]}
    rows = []
    for name, contexts in decode_cases.items():
        rows += bench_decode(name, contexts, copy_gbs, props.multi_processor_count, reps)
    prefill_rows = bench_prefill(
        "prefill 4x2048 new on 0/0/2048/2048 cached", [2048] * 4, [0, 0, 2048, 2048], reps
    )
    prefill_rows += bench_prefill(
        "mixed 1x512 chunk on 1024 + 63 decodes @2048", [512] + [1] * 63, [1024] + [2047] * 63, reps
    )

    print(f"\n{'case':32} {'impl':24} {'us':>10} {'GB/s':>8} {'of copy bw':>10}")
    for row in rows:
        print(
            f"{row['case']:32} {row['impl']:24} {row['us']:10.1f} {row['gbs']:8.0f} {row['of_copy_bw']:10.2f}"
        )
    print(f"\n{'case':48} {'impl':20} {'us':>10} {'TFLOP/s':>8}")
    for row in prefill_rows:
        print(f"{row['case']:48} {row['impl']:20} {row['us']:10.1f} {row['tflops']:8.1f}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        result = {"device": props.name, "copy_gbs": copy_gbs, "decode": rows, "prefill": prefill_rows}
        with open(os.path.join(out_dir, "attention_microbench.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
