"""Reasoning parsers: `<think>` reasoning split from the answer, whole and streamed alike."""

from __future__ import annotations

import pytest

from tests.unit.stream_chunkings import chunkings, run_stream
from tokenmill.server.reasoning import REASONING_PARSERS, get_reasoning_parser

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
QWEN3_THINKING_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_2507_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n"
QWEN3_NO_THINKING_PROMPT = QWEN3_THINKING_PROMPT + "<think>\n\n</think>\n\n"

# (parser, in_reasoning, output, reasoning, content)
CASES = [
    (
        "deepseek_r1",
        True,
        "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.",
        "Okay, 2+2 is 4.\n",
        "\n\nThe answer is **4**.",
    ),
    ("deepseek_r1", True, "<think>\nLet me think.\n</think>\n\n4", "\nLet me think.\n", "\n\n4"),
    (
        "deepseek_r1",
        True,
        "Still thinking when max_tokens hit <th",
        "Still thinking when max_tokens hit <th",
        None,
    ),
    ("deepseek_r1", True, "</think>Straight to it.", None, "Straight to it."),
    (
        "deepseek_r1",
        False,
        "Just the answer, <think> mid-text is content.",
        None,
        "Just the answer, <think> mid-text is content.",
    ),
    (
        "qwen3",
        False,
        "<think>\nThe user asks 2+2.\n</think>\n\n2 + 2 = 4.",
        "\nThe user asks 2+2.\n",
        "\n\n2 + 2 = 4.",
    ),
    (
        "qwen3",
        False,
        "2 + 2 = 4. No tags here, a < sign and </thin.",
        None,
        "2 + 2 = 4. No tags here, a < sign and </thin.",
    ),
    ("qwen3", True, "The user asks 2+2.\n</think>\n\n4", "The user asks 2+2.\n", "\n\n4"),
    ("qwen3", False, "  <think>unfinished", "unfinished", None),
    ("qwen3", False, "", None, None),
]


@pytest.mark.parametrize(("parser", "in_reasoning", "text", "reasoning", "content"), CASES)
def test_extract(parser, in_reasoning, text, reasoning, content):
    assert tuple(get_reasoning_parser(parser).extract(text, in_reasoning=in_reasoning)) == (
        reasoning,
        content,
    )


@pytest.mark.parametrize(("parser", "in_reasoning", "text", "reasoning", "content"), CASES)
def test_streaming_in_any_cutting_equals_the_whole_output(parser, in_reasoning, text, reasoning, content):
    reasoning_parser = get_reasoning_parser(parser)
    for pieces in chunkings(text):
        deltas = run_stream(reasoning_parser.stream(in_reasoning=in_reasoning), pieces)
        streamed = (
            "".join(d.reasoning or "" for d in deltas) or None,
            "".join(d.content or "" for d in deltas) or None,
        )
        assert streamed == (reasoning, content), pieces


def test_markers_split_across_deltas_are_held_and_the_end_is_reported():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert tuple(stream.feed("<thi")) == (None, None)
    assert tuple(stream.feed("nk>Hmm</")) == ("Hmm", None)
    assert not stream.reasoning_ended
    assert tuple(stream.feed("think>Ans")) == (None, "Ans")
    assert stream.reasoning_ended
    assert tuple(stream.feed("wer")) == (None, "wer")
    assert tuple(stream.finish()) == (None, None)


def test_where_the_output_starts_follows_the_prompt():
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    assert r1.starts_in_reasoning(R1_PROMPT) and not r1.reasoning_ended_in_prompt(R1_PROMPT)
    assert qwen3.starts_in_reasoning(QWEN3_2507_PROMPT)
    assert not qwen3.starts_in_reasoning(QWEN3_THINKING_PROMPT)
    assert qwen3.reasoning_ended_in_prompt(QWEN3_NO_THINKING_PROMPT)
    assert not qwen3.starts_in_reasoning(QWEN3_NO_THINKING_PROMPT)
    assert not r1.starts_in_reasoning(QWEN3_NO_THINKING_PROMPT)
    assert not qwen3.reasoning_ended_in_prompt(QWEN3_THINKING_PROMPT)


def test_qwen3_without_the_prompt_guesses_from_the_output():
    qwen3 = get_reasoning_parser("qwen3")
    assert tuple(qwen3.extract("thinking</think>answer")) == ("thinking", "answer")
    assert tuple(qwen3.extract("just an answer")) == (None, "just an answer")
    assert tuple(get_reasoning_parser("deepseek_r1").extract("no end yet")) == ("no end yet", None)


def test_registry_and_end_marker():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3"}
    assert all(get_reasoning_parser(name).end_marker == "</think>" for name in REASONING_PARSERS)
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
