"""Where Gemma rounds in bf16, the Gemma model (CPU ops) rounds as transformers does, bit for bit:
the embedding scale sqrt(hidden) cast to bf16 before the multiply (sqrt(48) = 6.928 becomes
6.9375), and the norms' (x / rms(x)) * (1 + w) computed in float32 and rounded once, with w
rounded to bf16 first as transformers holds it (the checkpoint here is fp32). Whole-model
bf16 runs differ from transformers' in attention's and the matmuls' summation order, which hides
these two (fp32 tests cannot see them at all), so they are checked here one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.engine.gemma_checkpoints import write_gemma_checkpoint
from tests.engine.hf_oracle import hf_load_kwargs
from tokenmill import LLM


def test_bf16_embedding_scale_and_norms_round_like_transformers(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    path = write_gemma_checkpoint(tmp_path / "g2", "gemma2", tiny_tokenizer, seed=3, hidden_size=48)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **hf_load_kwargs(str(path))).eval()
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=64, attention_backend="torch")
    model = llm.engine.runner.model
    ids = torch.arange(5, 200)

    assert model.embed_scale.dtype == torch.bfloat16 and float(model.embed_scale) == 6.9375
    with torch.inference_mode():
        ours = F.embedding(ids, model.embed_tokens).mul_(model.embed_scale)
        assert torch.equal(ours, hf.model.embed_tokens(ids))

        x = torch.randn(7, 48, generator=torch.Generator().manual_seed(0)).mul_(4).to(torch.bfloat16)
        hf_layer = hf.model.layers[1]
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            norm = getattr(model.layers[1], name)
            expected = getattr(hf_layer, name)(x)
            assert torch.equal(norm(x), expected), name
            assert torch.equal(model.ops.add_rms_norm(x.clone(), norm.weight, norm.eps, None, True), expected)
        assert torch.equal(model.ops.add_rms_norm(x.clone(), model.norm, 1e-6, None, True), hf.model.norm(x))
