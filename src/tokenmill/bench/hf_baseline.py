"""`transformers` baselines for `bench throughput`, measured in the same run on the same weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def load_hf_model(model: str | None, load_format: str, device: str, dtype: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill.config import ModelConfig
    from tokenmill.model.registry import resolve_model

    resolved = resolve_model(ModelConfig(model=model, load_format=load_format))  # type: ignore[arg-type]
    torch_dtype = getattr(torch, dtype)
    if resolved.format == "gguf":
        path = Path(resolved.path)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    elif resolved.format == "dummy":
        config = AutoConfig.from_pretrained(str(resolved.path))
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch_dtype)
    return hf.to(device).eval()


def _generate_rate(
    hf: Any, prompts: list[list[int]], output_len: int, batch_size: int, device: str
) -> dict[str, float]:
    total_out = 0
    started = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(
            prompts[i : i + batch_size], device=device
        )  # equal lengths: no pad tokens needed
        with torch.inference_mode():
            out = hf.generate(
                input_ids=batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
        total_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {
        "num_requests": len(prompts),
        "output_tokens": total_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": total_out / elapsed,
    }


def measure_generate(
    model: str | None, load_format: str, prompts: list[list[int]], output_len: int, device: str, dtype: str
) -> dict[str, dict[str, float]]:
    """`generate()` at batch 1 and at a padded (static) batch of 8."""
    hf = load_hf_model(model, load_format, device, dtype)
    _generate_rate(hf, prompts[:1], 4, 1, device)  # warm-up
    batch1 = _generate_rate(hf, prompts[: max(1, min(len(prompts), 4))], output_len, 1, device)
    batch8 = _generate_rate(hf, prompts[: max(8, min(len(prompts), 16))], output_len, 8, device)
    return {"generate_batch1": batch1, "generate_batch8_padded": batch8}


def measure_generate_batch(
    model: str | None, load_format: str, prompts: list[list[int]], output_len: int, device: str, dtype: str
) -> dict[str, dict[str, float]]:
    """transformers' continuous batching (`generate_batch`) with the paged SDPA attention (paged eager
    for models without SDPA)."""
    from transformers import GenerationConfig

    hf = load_hf_model(model, load_format, device, dtype)
    # Models transformers gives no SDPA path (Gemma 2: its attention soft cap) run its paged eager
    # attention, which skips the soft cap: fine for a timing, and the figure's name says which.
    attention = "paged|sdpa" if hf._supports_sdpa else "paged|eager"
    hf.set_attn_implementation(attention)
    name = "generate_batch_" + attention.replace("|", "_")
    config = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hf.generate_batch(prompts[:8], generation_config=config)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = hf.generate_batch(prompts, generation_config=config)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    total_out = sum(len(r.generated_tokens) for r in results.values())
    figures = {
        name: {
            "num_requests": len(prompts),
            "output_tokens": total_out,
            "elapsed_s": elapsed,
            "output_tokens_per_s": total_out / elapsed,
        }
    }
    # generate_batch also spends time starting its manager (and, in newer versions, warming up
    # CUDA graphs) inside the timed call. Where the outputs carry their lifespans, also report the
    # rate from the first request leaving the queue to the last finishing: the figure most
    # favourable to transformers, which is the one a speedup is taken against.
    spans = [getattr(r, "lifespan", None) for r in results.values()]
    if spans and all(span is not None and min(span) >= 0 for span in spans):
        window = max(span[1] for span in spans) - min(span[0] for span in spans)
        if window > 0:
            figures[f"{name}_processing_window"] = {
                "num_requests": len(prompts),
                "output_tokens": total_out,
                "elapsed_s": window,
                "output_tokens_per_s": total_out / window,
            }
    return figures
