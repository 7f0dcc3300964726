"""Disaggregation's wire alone: how long one batch of prompt blocks takes from the producer's KV pool
to the consumer's, through the real sender, consumer and receiver (ZMQ over ipc, msgspec headers).

Times the three host-side stages a transfer costs: the producer's send (gather, device-to-host copy,
framing), the consumer's accept (`KVConsumer.poll`: receive and check), and the consumer worker's
load (into its device blocks). The default shape is one 4,096-token prompt of Llama-3.1-8B (256
blocks of 16 tokens, 32 layers of 8 KV heads x 128, bf16: 2 MiB a block, 512 MiB in all); on a
CUDA device the pools live on it, on the CPU in host memory.
  python benchmarks/kv_transfer_microbench.py [--device cuda] [--blocks 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=256, help="blocks in one transfer (default 256 = 4,096 tokens)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result-dir", default=None, help="write a JSON result here")
    parser.add_argument("--name", default=None, help="result file name suffix")
    args = parser.parse_args(argv)

    import torch

    from tokenmill.core.kv_connector_metadata import KVReceiveMetadata, KVSendMetadata
    from tokenmill.core.kv_transfer import KVConsumer
    from tokenmill.worker.kv_connector.transfer import KVReceiverWorker, KVSenderWorker, kv_layout

    device = torch.device(args.device)
    num_pool_blocks = args.blocks + 8
    shape = (2, num_pool_blocks, args.block_size, args.kv_heads, args.head_dim)
    source = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    target = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    layout = kv_layout("bench", args.block_size, source)
    address = f"ipc://{tempfile.mkdtemp(prefix='tm-kvbench-')}/kv"
    consumer = KVConsumer(address, layout, claim_timeout_s=600, max_bytes=1 << 40)
    sender = KVSenderWorker(source, layout, address)
    receiver = KVReceiverWorker(target, layout)
    time.sleep(0.2)  # the PUSH socket connects asynchronously

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    send_s, accept_s, load_s = [], [], []
    for repeat in range(args.repeats):
        blocks = list(range(args.blocks))
        keys = [f"{repeat}-{i}".encode() for i in blocks]
        meta = KVSendMetadata(blocks, keys, [[i % 97] * args.block_size for i in blocks], [f"t{repeat}"])
        sync()
        t0 = time.perf_counter()
        sender.start_load_kv(meta)
        sender.wait_for_load()
        t1 = time.perf_counter()
        while consumer.blocks_received < (repeat + 1) * args.blocks:
            consumer.poll()
        t2 = time.perf_counter()
        payloads = [consumer._entries.pop(k)[1] for k in keys]  # noqa: SLF001 - what a claim takes
        load = KVReceiveMetadata([b + 4 for b in blocks], payloads)
        sync()
        t3 = time.perf_counter()
        receiver.start_load_kv(load)
        receiver.wait_for_load()
        sync()
        t4 = time.perf_counter()
        send_s.append(t1 - t0)
        accept_s.append(t2 - t1)
        load_s.append(t4 - t3)
        for s, t in zip(source, target, strict=True):
            assert torch.equal(s[:, : args.blocks], t[:, 4 : 4 + args.blocks]), "the blocks arrived changed"
        for t in target:
            t.zero_()
    sender.release()
    consumer.close()

    megabytes = args.blocks * layout.bytes_per_block / 2**20
    totals = [a + b + c for a, b, c in zip(send_s, accept_s, load_s, strict=True)]
    metrics = {
        "megabytes_per_transfer": megabytes,
        "send_s_median": statistics.median(send_s),
        "accept_s_median": statistics.median(accept_s),
        "load_s_median": statistics.median(load_s),
        "total_s_median": statistics.median(totals),
        "send_s": send_s,
        "accept_s": accept_s,
        "load_s": load_s,
    }
    print(
        f"{megabytes:.0f} MiB per transfer on {args.device}: send {metrics['send_s_median'] * 1e3:.1f} ms, "
        f"accept {metrics['accept_s_median'] * 1e3:.1f} ms, load {metrics['load_s_median'] * 1e3:.1f} ms, "
        f"total {metrics['total_s_median'] * 1e3:.1f} ms ({megabytes / 1024 / metrics['total_s_median']:.2f} GiB/s)"
    )
    if args.result_dir:
        from tokenmill.bench.results import write_result

        name = f"kv-transfer-microbench-{args.device}-{args.name}" if args.name else None
        print(f"wrote {write_result('kv_transfer_microbench', vars(args), metrics, args.result_dir, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
