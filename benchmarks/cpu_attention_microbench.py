"""The C++ CPU paged-attention kernel alone on decode rows (one query token each), SmolLM2-135M's
shape by default (9 query heads, 3 KV heads, head_dim 64, 16-token blocks): thread CPU time a call.

`--layers N` spreads the calls over N separate caches (as a step's layers do) so that the keys and
values come from further away than L2; `--layers 1` keeps them hot.

    PYTHONPATH=src python benchmarks/cpu_attention_microbench.py --batch 1 --context 160 --layers 30
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="decode rows (requests) a call")
    parser.add_argument("--context", type=int, default=160, help="tokens of context per request")
    parser.add_argument("--layers", type=int, default=30, help="separate caches the calls cycle over")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()

    from tokenmill.kernels.cpu.build import load_cpu_kernels

    load_cpu_kernels()
    torch.set_num_threads(args.threads)
    batch, ctx, bs = args.batch, args.context, args.block_size
    blocks_per_req = -(-ctx // bs)
    caches = [
        torch.randn(2, batch * blocks_per_req + 1, bs, args.kv_heads, args.head_dim).to(getattr(torch, args.cache_dtype))
        for _ in range(args.layers)
    ]
    tables = torch.randperm(batch * blocks_per_req).to(torch.int32).view(batch, blocks_per_req).contiguous()
    q = torch.randn(batch, args.heads, args.head_dim)
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    attention = torch.ops.tokenmill_cpu.paged_attention
    calls = max(args.layers, 60 // args.layers * args.layers)
    kv_bytes = batch * ctx * args.kv_heads * args.head_dim * caches[0].element_size() * 2
    for _ in range(args.rounds):
        started = time.thread_time()
        for i in range(calls):
            attention(out, q, caches[i % args.layers], starts, seq_lens, tables, args.head_dim**-0.5, 16, 0, 0.0, None)
        per_call = (time.thread_time() - started) / calls
        print(
            f"batch {batch}, context {ctx}, {args.layers} caches: {per_call * 1e6:.1f} us a call, "
            f"{kv_bytes / per_call / 1e9:.1f} GB/s of keys and values"
        )


if __name__ == "__main__":
    main()
