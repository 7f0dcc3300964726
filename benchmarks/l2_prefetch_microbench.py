"""Does prefetching o_proj into L2 during the small attention kernels shorten a decode layer?

One CUDA graph of 32 "layers", each: a window of small kernels (standing in for RoPE + KV write,
paged attention and its split merge, which read little memory) followed by the batch-1 o_proj
matmul of Llama-3.1-8B over that layer's own weight (so L2 holds none of it unless prefetched).
Variants: no prefetch; the weight prefetched on a side stream during the window, with the `bulk`
(cp.async.bulk.prefetch.L2) or `load` (evict_last loads) kernel. Also the window alone and the
matmul alone. Times are per layer.

    PYTHONPATH=src python benchmarks/l2_prefetch_microbench.py

Result on an H200 (BENCHMARKS.md): it does not pay. cuBLAS's o_proj takes 12.9 us from HBM and
still 10.3 us with the weight already in L2, so at most ~2.6 us a layer is there to win, and the
prefetch traffic running beside the window costs about that much. The engine does not prefetch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# -- two ways to pull a weight into L2 ------------------------------------------------------------
# `bulk`: Hopper's cp.async.bulk.prefetch.L2.global, one instruction per 8 KiB chunk, no data
# brought into the SMs (sm_90+). `load`: ordinary loads with the evict_last hint, folded into a
# value nobody reads.

_BULK_CHUNK_BYTES = 8192  # must match the literal in the bulk kernel's asm
_BULK_LANES = 32  # one warp per program, one chunk per thread: programs spread over all SMs
_LOAD_BLOCK = 8192  # int32 words per program (32 KiB): 8 independent 16-byte loads per thread


@triton.jit
def _bulk_prefetch_kernel(base_ptr, sink_ptr, num_bytes, num_chunks, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # Lanes past the end re-prefetch the last chunk (harmless) so every address is valid; the
    # last chunk starts early enough to end at the tensor's end.
    start = tl.minimum(idx, num_chunks - 1).to(tl.int64) * 8192
    start = tl.minimum(start, num_bytes - 8192)
    token = tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 8192;\n\tmov.u32 $0, 0;",
        "=r,l",
        [base_ptr + start],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.store(sink_ptr + idx, token, mask=idx < num_chunks)


@triton.jit
def _load_prefetch_kernel(base_ptr, sink_ptr, numel, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(base_ptr + offs, mask=offs < numel, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.xor_sum(words, axis=0))


def _storage_bytes(weight: torch.Tensor) -> torch.Tensor:
    """The weight's memory as a flat uint8 tensor (a transposed view is read in storage order)."""
    base = weight if weight.is_contiguous() else weight.t()
    if not base.is_contiguous():
        raise ValueError(
            f"prefetch_to_l2 needs a contiguous or transposed-contiguous tensor, got strides {weight.stride()}"
        )
    return base.reshape(-1).view(torch.uint8)


class L2Prefetcher:
    """Issues L2 prefetches of weight matrices; holds the sink buffer the kernels write."""

    def __init__(self, device: torch.device, method: str = "load") -> None:
        if method not in ("bulk", "load"):
            raise ValueError(f"L2 prefetch method must be 'bulk' or 'load', got {method!r}")
        self.method = method
        self.sink = torch.zeros(1 << 16, dtype=torch.int32, device=device)

    def prefetch(self, weight: torch.Tensor) -> None:
        data = _storage_bytes(weight)
        num_bytes = data.numel()
        if num_bytes < _BULK_CHUNK_BYTES:
            return
        if self.method == "bulk":
            num_chunks = -(-num_bytes // _BULK_CHUNK_BYTES)
            if num_chunks > self.sink.numel():
                raise ValueError(f"{num_bytes} bytes is more than this prefetcher's sink covers")
            grid = (-(-num_chunks // _BULK_LANES),)
            _bulk_prefetch_kernel[grid](
                data, self.sink, num_bytes, num_chunks, BLOCK=_BULK_LANES, num_warps=1
            )
        else:
            words = data[: num_bytes // 4 * 4].view(torch.int32)
            programs = -(-words.numel() // _LOAD_BLOCK)
            if programs > self.sink.numel():
                raise ValueError(f"{num_bytes} bytes is more than this prefetcher's sink covers")
            _load_prefetch_kernel[(programs,)](
                words, self.sink, words.numel(), BLOCK=_LOAD_BLOCK, num_warps=8
            )


def graph_us_per_layer(body, layers: int) -> float:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / layers * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--window-kernels", type=int, nargs="+", default=[0, 2, 4, 6])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shape", default="4096x4096", help="in x out of the matmul (o_proj)")
    args = parser.parse_args()
    k_in, n_out = (int(v) for v in args.shape.split("x"))
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(0), "L2", torch.cuda.get_device_properties(0).L2_cache_size >> 20, "MiB")
    # In-major storage, as the engine keeps matmul weights on CUDA (see CausalLM).
    weights = [torch.randn(k_in, n_out, device=device, dtype=torch.bfloat16).t() for _ in range(args.layers)]
    small = torch.randn(4096, device=device, dtype=torch.float32)
    side = torch.cuda.Stream()
    prefetchers = {}
    for method in ("bulk", "load"):
        try:
            p = L2Prefetcher(device, method)
            p.prefetch(weights[0])
            torch.cuda.synchronize()
            prefetchers[method] = p
        except Exception as exc:  # report and go on with the other method
            print(f"prefetch method {method} failed: {type(exc).__name__}: {exc}")

    def window(count: int) -> None:
        y = small
        for _ in range(count):
            y = torch.sigmoid(y)

    for batch in args.batch:
        x = torch.randn(batch, k_in, device=device, dtype=torch.bfloat16)
        for count in args.window_kernels:

            def plain(count=count, x=x):
                for w in weights:
                    window(count)
                    F.linear(x, w)

            def with_prefetch(p, count=count, x=x):
                main_stream = torch.cuda.current_stream()
                for w in weights:
                    side.wait_stream(main_stream)
                    with torch.cuda.stream(side):
                        p.prefetch(w)
                    window(count)
                    main_stream.wait_stream(side)
                    F.linear(x, w)

            def window_only(count=count):
                for _ in weights:
                    window(count)

            row = {
                "window": graph_us_per_layer(window_only, args.layers),
                "plain": graph_us_per_layer(plain, args.layers),
            }
            for method, p in prefetchers.items():
                row[method] = graph_us_per_layer(lambda p=p: with_prefetch(p), args.layers)
            cells = "  ".join(f"{name} {us:7.2f}" for name, us in row.items())
            print(f"batch {batch:3d} window kernels {count}: {cells}  (us per layer)")
    x = torch.randn(1, k_in, device=device, dtype=torch.bfloat16)
    only = graph_us_per_layer(lambda: [F.linear(x, w) for w in weights], args.layers)
    twice = graph_us_per_layer(lambda: [(F.linear(x, w), F.linear(x, w)) for w in weights], args.layers)
    mib = k_in * n_out * 2 / 2**20
    print(
        f"matmul alone: {only:.2f} us per layer ({mib:.0f} MiB weight); the same matmul again "
        f"right after (weight in L2): {twice - only:.2f} us"
    )
    for method, p in prefetchers.items():
        alone = graph_us_per_layer(lambda p=p: [p.prefetch(w) for w in weights], args.layers)
        then = graph_us_per_layer(lambda p=p: [(p.prefetch(w), F.linear(x, w)) for w in weights], args.layers)
        print(
            f"prefetch {method} alone: {alone:.2f} us ({mib * 2**20 / alone / 1e6:.2f} TB/s); prefetch then matmul, one stream: {then:.2f} us"
        )


if __name__ == "__main__":
    main()
