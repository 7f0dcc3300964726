"""Tiny random PEFT LoRA adapters for the tests, and the oracle: transformers with the adapter merged."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    scale: float = 0.2,
) -> Path:
    """A LoRA adapter of `base_dir` with random A and B (PEFT initializes B to zero, which would
    make every adapter the base model), saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, init_lora_weights=False,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path | None):
    """The transformers model of `base_dir` with the adapter merged into its weights (None: the base)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@torch.no_grad()
def greedy_tokens(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
