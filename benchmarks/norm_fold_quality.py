"""Does folding the RMSNorm weights into the weights before quantizing them at load cost quality?

On a GPU, `--quantization fp8` at load folds each decoder layer's input and post-attention norm
weights into qkv_proj and gate_up_proj (W <- W * w along the input dimension) before quantizing,
so that single-request decode steps skip the norm launches (registry.load_model). INT4 at load
does not fold: an INT4 group shares one grid, which folding stretches to its largest w * W. This
measures what folding does to each method's quality on the default model's real weights, with the
quality gate, on the CPU:

- the default model (GGUF, dequantized to fp32 by transformers) written as an HF checkpoint: the base;
- the same model with the norm weights folded into the matmul weights and the norms set to ones,
  in fp32: the same function up to one fp32 rounding (its unquantized gate row says how close);
- each method quantized at load from the unfolded and from the folded checkpoint, scored against
  the base.

    PYTHONPATH=src python benchmarks/norm_fold_quality.py [--methods fp8 awq gptq]

Writes benchmarks/results/norm-fold-quality-cpu-<methods>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

# The decoder layer's norm -> the projections that read its output (HF Llama names).
FOLDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def fold_norm_weights(model) -> int:
    """Fold every decoder layer's input / post-attention norm weight into the projections after
    it, in place, and set the norm weights to one. Returns the number of weights changed."""
    changed = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for norm_name, projections in FOLDS.items():
                norm = getattr(layer, norm_name)
                for projection in projections:
                    module = layer.get_submodule(projection)
                    if module.bias is not None:
                        raise ValueError(f"{projection} has a bias; the fold assumes none")
                    module.weight.mul_(norm.weight.to(module.weight.dtype)[None, :])
                    changed += 1
                norm.weight.fill_(1.0)
    return changed


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """(unfolded, folded) fp32 HF checkpoints of the default model, each with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.model.loader.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    paths = []
    for name, fold in (("unfolded", False), ("folded", True)):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        if fold:
            print(f"folded the norm weights into {fold_norm_weights(model)} weights")
        path = root / name
        _save(model, path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def _save(model, path: Path) -> None:
    """model.save_pretrained, which transformers refuses for a model loaded from a GGUF file."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized floats now
    config.save_pretrained(path)
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", default=["fp8", "awq", "gptq"])
    parser.add_argument("--result-dir", default="benchmarks/results")
    args = parser.parse_args()

    from tokenmill.args import EngineArgs
    from tokenmill.bench.results import write_result
    from tokenmill.quality.gate import measure_base, measure_candidate
    from tokenmill.quality.text_set import TextSetOptions
    from tokenmill.quality.verdict import Thresholds, judge

    options = TextSetOptions()  # the gate's defaults: the whole shipped text set
    thresholds = Thresholds()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        unfolded, folded = write_checkpoints(Path(tmp))

        def engine(path: Path, method: str | None) -> EngineArgs:
            return EngineArgs(model=str(path), quantization=method, device="cpu", dtype="float32")

        text_set, reference = measure_base(engine(unfolded, None), options)
        candidates = {"folded, unquantized": engine(folded, None)}
        for method in args.methods:
            candidates[f"{method}, unfolded"] = engine(unfolded, method)
            candidates[f"{method}, folded"] = engine(folded, method)
        for name, candidate in candidates.items():
            metrics = measure_candidate(candidate, text_set, reference, options)
            passed = judge(metrics, thresholds).passed
            rows[name] = {**dataclasses.asdict(metrics), "passed": passed}
            ratio = metrics.candidate_perplexity / metrics.base_perplexity
            print(
                f"{name:<22} ppl ratio {ratio:6.4f}  mean KL {metrics.mean_kl:.4f}  top-1 "
                f"{metrics.top1_agreement:.3f}  greedy {metrics.greedy_agreement:.3f}  {'pass' if passed else 'FAIL'}",
                flush=True,
            )
    path = write_result(
        "norm-fold-quality",
        config={"model": "default (SmolLM2-135M-Instruct GGUF, dequantized to fp32)", "device": "cpu",
                "dtype": "float32", "text_set": dataclasses.asdict(options),
                "thresholds": dataclasses.asdict(thresholds)},
        metrics=rows,
        out_dir=args.result_dir,
        name=f"norm-fold-quality-cpu-{'-'.join(args.methods)}",
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
