"""The fused MoE layer against a loop over experts and transformers' MoE block, Qwen3-30B-A3B shapes.

One MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts of intermediate 768, top-8, bf16) at
1..512 tokens, the same random weights in each:

- tokenmill: SparseMoEBlock with the CUDA ops (router matmul, routing in one Triton launch,
  fused_moe: align, grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM with the routing
  weight, sum over k), eager launches and replayed from a CUDA graph (how decode steps run);
- loop: the same block with the per-expert loop (TorchMoEOps: pairs sorted by expert, two
  matmuls per expert that got tokens; it reads the counts back to the host, so eager only);
- transformers: Qwen3MoeSparseMoeBlock, with its "grouped_mm" experts (what from_pretrained
  picks when torch has grouped_mm) and "eager" (its loop over the experts hit).

us per layer call (CUDA events, median of rounds) and the expert weight bytes each call must read
(experts hit x 3 x I x H x 2 bytes) per second. Writes benchmarks/results/moe-microbench-*.json.

    PYTHONPATH=src python3 benchmarks/moe_microbench.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CONFIG = Path(__file__).parent / "configs" / "qwen3-30b-a3b" / "config.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def build_blocks(dtype: torch.dtype):
    """(transformers' block, ours with the CUDA ops, ours with the per-expert loop), same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from tokenmill.model.arch import ArchConfig
    from tokenmill.model.layers.cuda_linear import CudaLinearMethod
    from tokenmill.model.layers.layer_ops import select_layer_ops
    from tokenmill.model.layers.linear import process_weights_after_loading
    from tokenmill.model.layers.moe import SparseMoEBlock, TorchMoEOps, select_moe_ops

    raw = json.loads(CONFIG.read_text())
    hf_config = Qwen3MoeConfig.from_dict(raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf_block = Qwen3MoeSparseMoeBlock(hf_config).to(dtype).eval()
    with torch.no_grad():
        for param in hf_block.parameters():
            param.normal_(0.0, 0.02)
    arch = ArchConfig.from_hf_config(raw)
    assert arch.moe is not None
    blocks = []
    for moe_ops in (select_moe_ops("cuda"), TorchMoEOps()):
        block = SparseMoEBlock(
            arch.hidden_size, arch.moe, select_layer_ops("cuda"), moe_ops, linear_method=CudaLinearMethod(),
            device="cuda", dtype=dtype,
        )  # fmt: skip
        with torch.no_grad():
            block.gate.weight.copy_(hf_block.gate.weight)
            block.experts.gate_up_proj.copy_(hf_block.experts.gate_up_proj)
            block.experts.down_proj.copy_(hf_block.experts.down_proj)
        process_weights_after_loading(block)
        blocks.append(block)
    return hf_block, blocks[0], blocks[1], arch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="token counts")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--reps", type=int, default=10, help="calls per round")
    parser.add_argument("--result-dir", default="benchmarks/results", help="directory of the result JSON")
    parser.add_argument("--result-name", default=None, help="file name of the result JSON")
    args = parser.parse_args()

    import triton

    from tokenmill.bench.results import write_result
    from tokenmill.bench.timing import cuda_ms, graph_replay_ms

    dtype = torch.bfloat16
    hf_block, ours, loop, arch = build_blocks(dtype)
    moe = arch.moe
    expert_bytes = 3 * moe.expert_intermediate_size * arch.hidden_size * 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    print("tokens | tokenmill eager / graph | loop | transformers grouped_mm / eager (us) | tokenmill graph GB/s")
    rows = {}
    timing = {"reps": args.reps, "rounds": args.rounds, "warmup": 3}
    for num_tokens in (int(b) for b in args.batches.split(",")):
        x = torch.randn(num_tokens, arch.hidden_size, device="cuda", dtype=dtype)
        with torch.inference_mode():
            expected = None
            row: dict[str, float] = {}
            for impl in ("grouped_mm", "eager"):
                try:
                    hf_block.experts.config._experts_implementation = impl
                    out = hf_block(x[None])[0]
                    row[f"transformers_{impl}_us"] = 1000 * cuda_ms(lambda x=x: hf_block(x[None]), **timing)
                    expected = out if impl == "grouped_mm" or expected is None else expected
                except (KeyError, RuntimeError, ValueError) as err:  # not in this transformers / torch
                    print(f"  transformers {impl}: not run ({type(err).__name__}: {str(err)[:120]})")
            row["tokenmill_eager_us"] = 1000 * cuda_ms(lambda x=x: ours(x), **timing)
            row["tokenmill_graph_us"] = 1000 * graph_replay_ms(
                lambda x=x: ours(x), reps=args.reps, rounds=args.rounds
            )
            row["loop_us"] = 1000 * cuda_ms(lambda x=x: loop(x), **timing)
            got, looped = ours(x).float(), loop(x).float()
            _, ids = torch.topk(torch.softmax(ours.gate(x).float(), -1), moe.top_k, dim=-1)
            experts_hit = int(torch.unique(ids).numel())
        row["experts_hit"] = experts_hit
        row["expert_bytes_read"] = experts_hit * expert_bytes
        row["tokenmill_graph_expert_GBps"] = row["expert_bytes_read"] / row["tokenmill_graph_us"] / 1000
        row["max_rel_diff_vs_loop"] = float((got - looped).norm() / looped.norm())
        if expected is not None:
            row["max_rel_diff_vs_transformers"] = float((got - expected.float()).norm() / expected.float().norm())
        best_hf = min((v for k, v in row.items() if k.startswith("transformers_")), default=float("nan"))
        row["speedup_vs_best_transformers"] = best_hf / row["tokenmill_graph_us"]
        row["speedup_vs_loop"] = row["loop_us"] / row["tokenmill_graph_us"]
        rows[str(num_tokens)] = row
        print(
            f"{num_tokens:6d} | {row['tokenmill_eager_us']:8.1f} / {row['tokenmill_graph_us']:8.1f} | "
            f"{row['loop_us']:8.1f} | {row.get('transformers_grouped_mm_us', float('nan')):8.1f} / "
            f"{row.get('transformers_eager_us', float('nan')):8.1f} | {row['tokenmill_graph_expert_GBps']:6.0f} "
            f"(rel diff vs loop {row['max_rel_diff_vs_loop']:.1e}, vs transformers "
            f"{row.get('max_rel_diff_vs_transformers', float('nan')):.1e})"
        )
    config = {
        "shape": "qwen3-30b-a3b",
        "hidden": arch.hidden_size,
        "experts": moe.num_experts,
        "intermediate": moe.expert_intermediate_size,
        "top_k": moe.top_k,
        "dtype": str(dtype).removeprefix("torch."),
        "timing": timing,
        "triton": triton.__version__,
        "torch": torch.__version__,
    }
    print(f"wrote {write_result('moe-microbench', config, {'per_batch': rows}, args.result_dir, args.result_name)}")


if __name__ == "__main__":
    main()
