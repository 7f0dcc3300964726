"""Quality-gate figures of every quantized checkpoint layout on a tiny random Llama (the test
writers' checkpoints, tests/model/quantized_checkpoints.py), each against the 16-bit checkpoint it
was quantized from, plus the at-load methods. Runs on the CPU:

    PYTHONPATH=src:. python benchmarks/quality_gate_tiny.py

A random model's next-token distributions are nearly flat, so its perplexities are huge and its
argmaxes fragile: these figures compare the formats with each other, not with real models (for
those, `tokenmill quality-gate` on the model itself)."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument(
        "--source", default="llama", help="the tiny source (tests/model/quantized_checkpoints.py QUANT_SOURCES, "
        "or gemma2 / gemma3 / phi3); mixture-of-experts sources (qwen3-moe, ...) run the FP8 layouts only",
    )  # fmt: skip
    args = parser.parse_args()

    from tests.conftest import build_tiny_tokenizer
    from tests.model.quantized_checkpoints import (
        MOE_SOURCES,
        QUANT_LAYOUTS,
        write_quant_source,
        write_quantized_checkpoint,
    )

    from tokenmill.args import EngineArgs
    from tokenmill.bench.results import write_result
    from tokenmill.quality.gate import plan_gate, run_gate
    from tokenmill.quality.text_set import TextSetOptions
    from tokenmill.quality.verdict import Thresholds

    options = TextSetOptions(window=64, max_windows=12, greedy_prompts=8, greedy_prompt_tokens=16, greedy_tokens=8)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = write_quant_source(root / "source", args.source, build_tiny_tokenizer())
        moe = args.source in MOE_SOURCES  # their experts take FP8 only
        methods = ("fp8",) if moe else ("fp8", "awq", "gptq")
        candidates = {f"at-load {m}": EngineArgs(model=str(source), quantization=m) for m in methods}
        for layout in (name for name in QUANT_LAYOUTS if not moe or "fp8" in name):
            ckpt = write_quantized_checkpoint(source, root / layout, root / f"{layout}-ref", layout)
            candidates[layout] = EngineArgs(model=str(ckpt.path))
        for name, candidate in candidates.items():
            candidate.device, candidate.max_model_len = "cpu", 128
            base = str(source) if candidate.quantization is None else None
            report = run_gate(plan_gate(candidate, base), options, Thresholds())
            rows[name] = {**dataclasses.asdict(report.metrics), "passed": report.passed}
            m = report.metrics
            print(f"{name:<24} ppl ratio {m.candidate_perplexity / m.base_perplexity:6.3f}  mean KL {m.mean_kl:.4f}  "
                  f"top-1 {m.top1_agreement:.3f}  greedy {m.greedy_agreement}  {'pass' if report.passed else 'FAIL'}",
                  flush=True)  # fmt: skip
    config = {"options": dataclasses.asdict(options), "source": f"tiny {args.source} (hidden 128, 2 layers)"}
    path = write_result("quality-gate-tiny", config, rows, args.result_dir, name=f"quality-gate-tiny-{args.source}-cpu")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
