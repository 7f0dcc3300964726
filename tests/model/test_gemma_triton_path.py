"""The Gemma model's CUDA path, run on the CPU under TRITON_INTERPRET=1: the Triton layer ops
(add + RMSNorm with Gemma's float32 weight, GeGLU's gelu_tanh_mul, RoPE with the KV store in the
same launch) and the Triton attention backend (sliding windows, Gemma 2's soft cap, and for decode
steps RoPE, and Gemma 3's Q/K norms, inside the attention launch) give transformers' logits in fp32.

No GPU runs in CI, so this is where the launches Gemma takes on CUDA meet the oracle on every
commit. Two requests over a paged cache (tests/model/test_model_forward.py's harness): prefill
chunks mixed in one batch, then decode-only steps; prompts 2-3 windows long. The layer ops are
chosen by device (cuda -> Triton) when the model is built, so the test swaps the choice for the
build. Like the other interpreter tests, a subprocess runs the file when this process imported
triton compiled.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.engine.gemma_checkpoints import write_gemma_checkpoint  # noqa: E402
from tests.model.test_model_forward import BLOCK_SIZE, PagedHarness, _hf_logits  # noqa: E402
from tests.triton_interpreter import interpreted_run  # noqa: E402
from tokenmill.config import KernelConfig, ModelConfig  # noqa: E402
from tokenmill.model.registry import load_model, resolve_model  # noqa: E402

INTERPRETED_RUN = interpreted_run(__file__, timeout=600)  # run by the subprocess test below

interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="triton was imported compiled in this process; the subprocess test runs these"
)


@interpreted_only
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_triton_ops_and_attention_match_transformers(family, tmp_path, tiny_tokenizer, monkeypatch):
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.model import llama
    from tokenmill.model.layers.layer_ops import TritonLayerOps

    path = write_gemma_checkpoint(tmp_path / family, family, tiny_tokenizer, seed=11)
    monkeypatch.setattr(llama, "select_layer_ops", lambda device: TritonLayerOps())
    config = ModelConfig(model=str(path))
    resolved = resolve_model(config)
    arch = resolved.arch
    backend = TritonPagedBackend(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale, BLOCK_SIZE)
    fused_calls = []
    fused = backend.forward_decode_with_rope

    def counted(*args, **kwargs):
        fused_calls.append((kwargs["layer"], kwargs["qk_norm"]))
        return fused(*args, **kwargs)

    monkeypatch.setattr(backend, "forward_decode_with_rope", counted)
    model = load_model(config, arch, "cpu", torch.float32, backend, resolved=resolved, kernel=KernelConfig())
    assert isinstance(model.ops, TritonLayerOps)
    assert all(layer.self_attn.store_kv_in_rope for layer in model.layers)

    rng = random.Random(5)
    prompts = [[rng.randrange(5, arch.vocab_size) for _ in range(n)] for n in (48, 36)]
    harness = PagedHarness(model, seed=2)
    first, second = harness.add(prompts[0]), harness.add(prompts[1])
    harness.step([(first, 40), (second, 20)])  # prefill chunks in one batch
    harness.step([(first, 1), (second, 12)])  # a decode beside a chunk
    for _ in range(4):  # decode-only steps: Gemma 2 rotates inside the attention launch
        harness.step([(first, 1), (second, 1)])
    for _ in range(3):
        harness.step([(first, 1)])
    for r, prompt in ((first, prompts[0]), (second, prompts[1])):
        torch.testing.assert_close(harness.logits_of(r), _hf_logits(path, prompt), rtol=1e-4, atol=1e-4)
    # Decode-only steps rotate inside the attention launch; Gemma 3's Q/K norms (float32 1 + w)
    # are applied there too.
    assert fused_calls, "no decode step went through forward_decode_with_rope"
    windows = {arch.layer_sliding_window(i) for i in range(arch.num_layers)}
    assert {spec.sliding_window for spec, _ in fused_calls} == windows and len(windows) == 2
    if family == "gemma2":
        assert {spec.logits_soft_cap for spec, _ in fused_calls} == {1.0}
        assert all(qk_norm is None for _, qk_norm in fused_calls)
    else:
        assert all(qk_norm is not None and qk_norm.q_weight.dtype == torch.float32 for _, qk_norm in fused_calls)


@interpreted_only
@pytest.mark.parametrize("num_kv_splits", [None, 2], ids=["planned", "two-splits"])
def test_gpu_tests_gemma2_greedy_matches_transformers(num_kv_splits, tmp_path, tiny_tokenizer, monkeypatch):
    """tests/gpu/test_gemma_gpu.py's Gemma 2 (final cap 30) and its single-request prompt: the
    prompt in one chunk, then 15 single-request decode steps, each through the launch the GPU
    takes there (RoPE inside the attention launch, the 32-token single-request tiles), with the
    split count eager mode plans (1 at these lengths) or the 2 splits the CUDA-graph plan gives
    the full layers at max_model_len 256: the 16 greedy tokens are transformers' and so are the
    logits. (Transformers must apply the attention soft cap here: without it, its token 5
    differs, see tests/engine/test_hf_oracle_soft_cap.py.)"""
    from tests.engine.hf_oracle import hf_greedy
    from tests.gpu.test_gemma_gpu import _prompts
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.model import llama
    from tokenmill.model.layers.layer_ops import TritonLayerOps

    path = write_gemma_checkpoint(tmp_path / "g2", "gemma2", tiny_tokenizer, seed=11, final_logit_softcapping=30.0)
    monkeypatch.setattr(llama, "select_layer_ops", lambda device: TritonLayerOps())
    config = ModelConfig(model=str(path))
    resolved = resolve_model(config)
    arch = resolved.arch
    backend = TritonPagedBackend(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale, BLOCK_SIZE,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip
    fused = backend.forward_decode_with_rope
    fused_calls = []
    monkeypatch.setattr(backend, "forward_decode_with_rope", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    model = load_model(config, arch, "cpu", torch.float32, backend, resolved=resolved, kernel=KernelConfig())

    prompt = _prompts(arch.vocab_size, 1, seed=21)[0]
    expected = hf_greedy(str(path), prompt, 16)[0]
    harness = PagedHarness(model, seed=3)
    r = harness.add(prompt + [0] * 15)
    harness.step([(r, len(prompt))])
    ours = []
    for i in range(16):
        ours.append(int(harness.logits_of(r)[-1].argmax()))
        if i < 15:
            harness.requests[r].token_ids[len(prompt) + i] = ours[-1]
            harness.step([(r, 1)])
    assert ours == expected
    assert len(fused_calls) == 15 * arch.num_layers
    logits = harness.logits_of(r)[len(prompt) - 1 :]
    torch.testing.assert_close(logits, _hf_logits(path, prompt + ours[:15])[len(prompt) - 1 :], rtol=1e-4, atol=1e-4)


def test_cases_pass_in_an_interpreter_subprocess() -> None:
    if INTERPRETED:
        pytest.skip("this process runs the cases interpreted itself")
    INTERPRETED_RUN.assert_passes()
