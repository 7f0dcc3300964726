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


def assert_adapter_adds_its_product(llm, adapter_dir: Path, *, quantized: bool, tol: float) -> None:
    """Every adapted layer of `llm` (LoRA on, adapter in slot 0..): output = the layer's own method's
    product + x A^T B^T for tokens with the adapter, + nothing for the others."""
    import numpy as np

    from tokenmill.lora.request import LoRARequest
    from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

    runner = llm.engine.executor.driver_runner
    manager = runner.lora
    lora = LoRARequest("a", 1, str(adapter_dir))
    manager.add_lora(lora)
    adapter = manager._host[1].result(timeout=60)
    slot = int(manager.slots_for([lora], {1})[0])
    num_checked = 0
    for geometry in manager.geometries:
        layer = geometry.layer
        inner = layer.method.inner
        assert isinstance(inner, QuantizedLinearMethod) == quantized
        gen = torch.Generator().manual_seed(geometry.index)
        x = torch.randn(5, layer.in_features, generator=gen).to(runner.device, runner.dtype)
        residual = torch.randn(5, layer.out_features, generator=gen).to(runner.device, runner.dtype)
        manager.mapping.set(np.array([slot, slot, -1, slot, -1]))
        with torch.inference_mode():
            y = layer(x.clone(), residual=residual.clone())
            base = inner.apply(layer, x.clone(), residual=residual.clone())
        a, b = (t.to(runner.device, torch.float32) for t in adapter.layers[geometry.index])
        delta = torch.zeros(base.shape, device=runner.device)
        rank = manager.rank
        for part, (start, rows) in enumerate(zip(geometry.part_starts, geometry.part_rows, strict=True)):
            shrunk = x.float() @ a[part * rank : (part + 1) * rank].T
            delta[:, start : start + rows] = shrunk @ b[start : start + rows].T
        delta[[2, 4]] = 0  # tokens without an adapter
        torch.testing.assert_close(y.float(), base.float() + delta, rtol=tol, atol=tol)
        assert delta.abs().max() > 10 * tol  # the adapter does change this layer
        num_checked += 1
    manager.mapping.clear()
    assert num_checked == 4 * 2  # qkv, o, gate_up, down of both layers
