"""transformers as the oracle: greedy continuations and their logprobs on the same weights.

Every test that loads a transformers model as the oracle goes through `hf_load_kwargs`: a model
whose attention soft-caps its scores (Gemma 2) must run transformers' eager attention, the only
one that applies the cap. Some transformers releases let such a model load with another default
(SDPA), which silently drops the cap, and then the oracle itself is wrong (on an H100 machine's
transformers it gave the tiny Gemma 2 of tests/gpu/test_gemma_gpu.py another greedy token at
step 5 than the capped model has).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


def hf_load_kwargs(path: str) -> dict:
    """from_pretrained keyword arguments that make transformers compute what the checkpoint's
    config says: eager attention when the attention logits are soft-capped."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return {"attn_implementation": "eager"}
    return {}


def check_hf_applies_soft_cap(model) -> None:
    """Raises unless `model` runs an attention that applies its config's attention soft cap."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None and config._attn_implementation != "eager":
        raise AssertionError(
            f"transformers runs {config._attn_implementation!r} attention for a model with "
            f"attn_logit_softcapping={cap}: only 'eager' applies the cap; load it with hf_load_kwargs"
        )


@cache
def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **hf_load_kwargs(path))
    check_hf_applies_soft_cap(model)
    return model.eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = _hf_greedy(path, tuple(prompt_ids), max_new_tokens)
    return list(tokens), list(logprobs)


@cache
def _hf_greedy(
    path: str, prompt_ids: tuple[int, ...], max_new_tokens: int
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Greedy continuation with EOS ignored (not suppressed, as `min_new_tokens` would do), and
    the logprob of each chosen token: transformers' forward with its own KV cache, step by step."""
    model = load_hf(path)
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        out = model(torch.tensor([list(prompt_ids)]), use_cache=True)
        for _ in range(max_new_tokens):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp[token].item())
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tuple(tokens), tuple(logprobs)


def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> list[float]:
    """logprob of prompt token i+1 given tokens 0..i."""
    model = load_hf(path)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
