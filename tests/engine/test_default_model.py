"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end, against transformers' GGUF loader."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(None, device="cpu", max_model_len=512, seed=0)


def test_greedy_single_and_concurrent_equal_transformers(llm, default_model_path):
    tok = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "List three colors:",
    ]
    rng = random.Random(0)
    prompts = [tok.encode(t) for t in texts] + [
        [rng.randrange(100, 40000) for _ in range(rng.randint(5, 48))] for _ in range(12)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]
    assert single.outputs[0].token_ids == hf_greedy(str(default_model_path), prompts[0], 8)[0]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(str(default_model_path), prompt, 8)[0]
    llm.engine.check_invariants()
    from tokenmill.kernels.cpu.quant_gemv import gemm_available

    if gemm_available():  # then the 16-row decode steps above ran the batched quantized kernel
        assert llm.engine.runner.model.layers[0].mlp.down_proj.method.blocks_for_rows(16) is not None


def test_greedy_unchanged_by_chunking_preemption_and_caching(default_model_path):
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 40))] for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # float32 activations on every path: with quantized ones (cpu_activation_bits) a 1-4-row step
    # rounds differently from a larger one, so tokens may depend on how many requests shared a
    # step, which this test changes on purpose (preemption, 32-token steps).
    float_acts = {"cpu_activation_bits": 0}
    reference = LLM(
        None, device="cpu", max_model_len=128, enable_prefix_caching=False, kernel_config=float_acts
    ).generate([{"prompt_token_ids": p} for p in prompts], params)
    squeezed = LLM(
        None, device="cpu", max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=12, block_size=8,
        kernel_config=float_acts,
    )  # fmt: skip
    outputs = squeezed.generate([{"prompt_token_ids": p} for p in prompts + prompts[:4]], params)
    assert squeezed.engine.get_stats()["num_preemptions_total"] > 0
    for ref, out in zip(reference + reference[:4], outputs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    squeezed.engine.check_invariants()


def test_greedy_unchanged_by_the_prefill_cap_while_decoding(default_model_path):
    # Prompts admitted while others decode, 16 prompt tokens a step: chunk boundaries anywhere in a
    # prompt, decode rows and prefill chunks sharing steps; tokens equal a run without the cap.
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    float_acts = {"cpu_activation_bits": 0}  # as above: tokens must not depend on step composition
    runs = {}
    for cap in (0, 16):
        llm = LLM(
            None, device="cpu", max_model_len=128, max_num_batched_tokens=64,
            max_prefill_tokens_while_decoding=cap, kernel_config=float_acts,
        )  # fmt: skip
        runs[cap] = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        llm.engine.check_invariants()
    assert runs[16] == runs[0]


def test_chat_and_text(llm):
    out = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0, max_tokens=16)
    )[0]
    assert out.outputs[0].text.strip()
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stop_string_split_across_tokens(llm):
    tok = llm.get_tokenizer()
    prompt = "Count from one to twenty in words: one, two, three,"
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    # Pick a stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    boundary = len(pieces[3])
    stop = base.text[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and stop in base.text
    cut = base.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]
    llm.engine.check_invariants()


def test_stop_token_ids_min_tokens_and_eos(llm):
    prompt = "Write a short sentence about the sea."
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_token = base.token_ids[5]
    first = base.token_ids.index(stop_token)
    out = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token])
    )[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_token
    later = llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token], min_tokens=first + 1
        ),
    )[0].outputs[0]
    assert len(later.token_ids) > first + 1
    # A chat answer ends on EOS by itself; with ignore_eos it runs to max_tokens.
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=200))[
        0
    ].outputs[0]
    assert chat.finish_reason == "stop" and len(chat.token_ids) < 200
    forced = llm.chat(
        [{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    assert len(forced.outputs[0].token_ids) == 40 and forced.outputs[0].finish_reason == "length"


def test_seed_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    alone = llm.generate("Tell me a story:", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in (1, 2)] + [
        SamplingParams(temperature=0.8, max_tokens=16)
    ]
    mixed = llm.generate(
        ["Hello there", "Tell me a story:", "A poem:", "Numbers: 1, 2,"],
        [others[0], seeded, others[1], others[2]],
    )
    assert mixed[1].outputs[0].token_ids == alone
    reordered = llm.generate(
        ["Tell me a story:", "x y z"] * 1 + ["Tell me a story:"], [others[2], others[0], seeded]
    )
    assert reordered[2].outputs[0].token_ids == alone
    unseeded = llm.generate(["Tell me a story:"] * 2, SamplingParams(temperature=1.0, max_tokens=16))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_bad_input_raises_naming_the_field_and_engine_keeps_serving(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate({"prompt_token_ids": [1] * 600}, SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hi", SamplingParams(temperature=-1.0))
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hi", SamplingParams(max_tokens=100_000))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["fine", {"prompt_token_ids": [10**9]}], SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"
    out = llm.generate(
        ["still serving", "yes"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    llm.engine.check_invariants()


def _one_row_tokens_and_logprob_error(
    llm: LLM, default_model_path, text: str, tokens: int
) -> tuple[bool, float]:
    """Greedy decode of `text` alone (every decode step one row): (tokens equal transformers',
    max |logprob - transformers' logprob| of those tokens)."""
    prompt = llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    expected, logprobs = hf_greedy(str(default_model_path), prompt, tokens)
    ours = [pos[t].logprob for pos, t in zip(out.logprobs, out.token_ids, strict=True)]
    return out.token_ids == expected, max(abs(a - b) for a, b in zip(ours, logprobs, strict=True))


def test_one_row_steps_read_the_gguf_blocks_and_match_transformers(llm, default_model_path):
    """A request decoding alone multiplies by the GGUF's Q4_1 / Q8_0 blocks (the float32 copies
    kept for that are freed); with float32 activations (cpu_activation_bits 0) tokens and
    logprobs are transformers' on the dequantized weights."""
    from tokenmill.model.layers.quantized_linear import quantized_blocks

    model = llm.engine.runner.model
    for layer in model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear = layer.get_submodule(name)
            assert quantized_blocks(linear).quant_type == 0, name  # Q4_1 in this file
            assert getattr(linear, "plain_weight", None) is None, name
    assert quantized_blocks(model.lm_head).quant_type == 1  # the tied table is Q8_0
    # float32 activations and a float32 KV cache: transformers' arithmetic up to summation order
    float_llm = LLM(
        None, device="cpu", max_model_len=128, kernel_config={"cpu_activation_bits": 0, "cpu_kv_cache_dtype": "float32"}
    )
    assert float_llm.engine.runner.kv_cache_dtype == torch.float32
    assert quantized_blocks(float_llm.engine.runner.model.lm_head).vnni is None
    same, error = _one_row_tokens_and_logprob_error(
        float_llm, default_model_path, "The three primary colors are", 24
    )
    assert same and error < 1e-4


def test_quantized_activation_steps_keep_transformers_greedy_tokens(llm, default_model_path):
    """Where the CPU has AVX-512 VNNI or AVX2, one-row steps quantize the activations to 16-bit integers
    (the default cpu_activation_bits): not the float32 product, so logprobs move a little, but
    the greedy tokens of these prompts stay transformers' (8 bits, llama.cpp's scheme, flipped
    near-ties of three of them within 30 tokens)."""
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available
    from tokenmill.model.layers.quantized_linear import quantized_blocks

    if not int8_available():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: one-row steps keep float32 activations")
    assert quantized_blocks(llm.engine.runner.model.lm_head).vnni is not None
    for text in (
        "The three primary colors are",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The capital of France is",
        "List three colors:",
    ):
        same, error = _one_row_tokens_and_logprob_error(llm, default_model_path, text, 32)
        assert same, text
        assert error < 5e-3, (text, error)


def test_the_kv_cache_is_float16_under_the_gguf_weights_unless_asked(llm, default_model_path):
    """As llama.cpp's default: the GGUF model's float32 activations over a float16 KV cache (where
    the C++ kernels convert rows as they read them), which the greedy-token tests above run with;
    --kv-cache-dtype or cpu_kv_cache_dtype float32 keeps float32."""
    from tokenmill.attention.cpu_paged import _vector_build

    runner = llm.engine.runner
    assert runner.dtype == torch.float32
    assert runner.kv_cache_dtype == (torch.float16 if _vector_build() else torch.float32)
    for options in ({"kv_cache_dtype": "float32"}, {"kernel_config": {"cpu_kv_cache_dtype": "float32"}}):
        assert LLM(None, device="cpu", max_model_len=64, **options).engine.runner.kv_cache_dtype == torch.float32


def test_quantized_one_row_steps_can_be_turned_off(default_model_path):
    from tokenmill.model.layers.quantized_linear import quantized_blocks

    plain = LLM(None, device="cpu", max_model_len=128, cpu_quantized_gemv=False)
    qkv_proj = plain.engine.runner.model.layers[0].self_attn.qkv_proj
    assert quantized_blocks(qkv_proj) is None and getattr(qkv_proj, "plain_weight", None) is not None


def test_ngram_speculation_keeps_greedy_output_on_a_copy_task(llm):
    """The default model rewriting text given in its prompt: n-gram drafts are verified (some
    accepted), and the greedy output is the one without speculation, alone and four together."""
    tok = llm.get_tokenizer()
    source = "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n    return result\n"
    texts = [
        f"Repeat this code exactly:\n{source}\n",
        f"Copy the following text word for word: {source}",
        "Write the numbers from one to twenty in words, separated by commas: one, two, three,",
        f"Rename `result` to `acc` in:\n{source}\n",
    ]
    prompts = [{"prompt_token_ids": tok.encode(t)} for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    speculative = LLM(
        None, device="cpu", max_model_len=512, seed=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )  # fmt: skip
    for batch in (prompts[:1], prompts):
        expected = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in speculative.generate(batch, params, use_tqdm=False)]
        assert got == expected
    stats = speculative.engine.get_stats()
    # (How much is accepted is the benchmark's business; this small model copies loosely.)
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    speculative.engine.check_invariants()
