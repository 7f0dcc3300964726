"""transformers as the oracle: greedy continuations and their logprobs on the same weights."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (EOS ignored) and the logprob of each chosen token."""
    model = load_hf(path)
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> list[float]:
    """logprob of prompt token i+1 given tokens 0..i."""
    model = load_hf(path)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
