"""Host time of one eager attention call (KV store + paged attention) with and without FastLauncher.

A mixed prefill + decode step runs attention eagerly between its CUDA-graph pieces, once per layer:
its host time is what the step pays 32 times (Llama-3.1-8B shapes). This times the Triton
backend's `forward` on one mixed batch (decodes beside one prefill chunk) with
TOKENMILL_TRITON_FAST_LAUNCH=0 (Triton's own dispatch) and =1 (kernels/triton/fast_launch.py),
alternating rounds in one process, and checks the outputs are equal bit for bit.

Host time: bursts of `--burst` calls between synchronizations, timed on the host only (the CUDA
queue holds far more launches than a burst, so the host never waits for the GPU inside one).

    PYTHONPATH=src python3 benchmarks/triton_launch_host.py [--decodes 63] [--chunk 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.triton_paged import TritonPagedBackend
from tokenmill.bench.paged_batch import scattered_paged_batch
from tokenmill.bench.results import write_result

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B
DTYPE = torch.bfloat16


def mixed_batch(
    decodes: int, chunk: int, context: int
) -> tuple[AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    """One request with a `chunk`-token query (chunk 1 with context: a decode) beside `decodes` decodes."""
    query_lens = [chunk] + [1] * decodes
    context_lens = [0 if chunk > 1 else context] + [context] * decodes
    meta, num_blocks = scattered_paged_batch(query_lens, context_lens, BLOCK)
    n = sum(query_lens)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qkv = [
        torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
        torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
        torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
    ]
    return meta, cache, qkv


def host_us_per_call(call, bursts: int, burst: int) -> float:
    times = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(burst):
            call()
        times.append((time.perf_counter() - started) / burst)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decodes", type=int, default=63)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--name", default=None, help="result file name")
    args = parser.parse_args()

    meta, cache, (q, k, v) = mixed_batch(args.decodes, args.chunk, args.context)
    backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
    decode_meta, decode_cache, (dq, dk, dv) = mixed_batch(args.decodes, 1, args.context)

    def mixed() -> torch.Tensor:
        return backend.forward(q, k, v, cache, meta)

    def decode() -> torch.Tensor:
        return backend.forward(dq, dk, dv, decode_cache, decode_meta)

    results: dict[str, dict[str, list[float]]] = {
        "mixed": {"0": [], "1": []},
        "decode_only": {"0": [], "1": []},
    }
    outputs = {}
    for mode in ("0", "1"):  # compile and warm both paths; keep each mode's output
        os.environ["TOKENMILL_TRITON_FAST_LAUNCH"] = mode
        for _ in range(3):
            out = mixed().clone()
        outputs[mode] = out
        decode()
    torch.cuda.synchronize()
    equal = bool(torch.equal(outputs["0"], outputs["1"]))
    for _ in range(args.rounds):
        for mode in ("0", "1"):
            os.environ["TOKENMILL_TRITON_FAST_LAUNCH"] = mode
            results["mixed"][mode].append(host_us_per_call(mixed, args.bursts, args.burst))
            results["decode_only"][mode].append(host_us_per_call(decode, args.bursts, args.burst))
    metrics = {"outputs_equal": equal}
    for case, by_mode in results.items():
        off, on = statistics.median(by_mode["0"]), statistics.median(by_mode["1"])
        metrics[case] = {
            "host_us_triton_dispatch": off,
            "host_us_fast_launch": on,
            "rounds_triton_dispatch": by_mode["0"],
            "rounds_fast_launch": by_mode["1"],
            "saved_us_per_call": off - on,
        }
        print(f"{case}: host {off:.1f} us per call with Triton's dispatch, {on:.1f} with FastLauncher")
    print(f"outputs equal bit for bit: {equal}")
    config = {**vars(args), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK}
    path = write_result(
        "triton_launch_host",
        config,
        metrics,
        out_dir=os.environ.get("OUT", "benchmarks/results"),
        name=args.name,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
