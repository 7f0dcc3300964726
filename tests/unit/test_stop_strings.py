"""Stop strings: split across tokens, earliest match wins, include/exclude, streaming holdback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.stop_strings import StopStringMatcher


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, tuple[str, int] | None]:
    """Appends pieces as a detokenizer would, stopping at the first match."""
    text = ""
    for piece in pieces:
        text += piece
        match = matcher.find(text, len(piece))
        if match is not None:
            return text, match
    return text, None


def test_stop_string_split_across_tokens():
    text, match = feed(StopStringMatcher(["</answer>"], False), ["The answer is 4</", "ans", "wer>", " more"])
    assert match == ("</answer>", len("The answer is 4"))
    assert text[: match[1]] == "The answer is 4"


def test_included_stop_string_is_kept():
    text, match = feed(StopStringMatcher(["STOP"], True), ["go go ST", "OP and", " on"])
    assert match == ("STOP", len("go go STOP"))
    assert text[: match[1]] == "go go STOP"


def test_earliest_match_wins_whatever_the_list_order():
    matcher = StopStringMatcher(["world", "o w", "hello world!"], False)
    assert matcher.find("hello world", len("hello world")) == ("o w", 4)


def test_on_the_same_start_the_shorter_wins():
    assert StopStringMatcher(["abcd", "ab"], False).find("xxabcd", 6) == ("ab", 2)
    assert StopStringMatcher(["abcd", "ab"], True).find("xxabcd", 6) == ("ab", 4)


def test_only_the_new_text_and_its_overlap_are_searched():
    matcher = StopStringMatcher(["stop"], False)
    # "stop" lies wholly in text checked on an earlier call: not reported again.
    assert matcher.find("stop and then more", len(" more")) is None
    assert matcher.find("xx sto", 1) is None
    assert matcher.find("xx stop", 1) == ("stop", 3)


def test_holdback_withholds_a_possible_stop_string_start():
    matcher = StopStringMatcher(["<|end|>", "###"], False)
    assert matcher.find("Hello <|en", 10) is None
    assert matcher.holdback == len("<|en")
    assert matcher.find("Hello <|en!", 1) is None
    assert matcher.holdback == 0
    assert matcher.find("Hello <|en! ##", 3) is None
    assert matcher.holdback == 2
    assert matcher.find("Hello <|en! ###", 1) == ("###", len("Hello <|en! "))
    assert matcher.holdback == 0
    assert StopStringMatcher(["<|end|>"], True).partial_match_len("Hello <|en") == 0


def test_bad_stop_lists_are_rejected():
    with pytest.raises(ValueError, match="stop strings"):
        StopStringMatcher([], False)
    with pytest.raises(ValueError, match="stop strings"):
        StopStringMatcher(["ok", ""], False)


STOPS = ["ab", "<|a", "ba", "bbb", "<|>", "a<"]


@settings(max_examples=300)
@given(
    pieces=st.lists(st.text(alphabet="ab<|>x", min_size=1, max_size=4), max_size=12),
    stops=st.lists(st.sampled_from(STOPS), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streaming_with_holdback_never_shows_text_that_is_cut_later(pieces, stops, include):
    """Each piece is one detokenizer step's new text."""
    matcher = StopStringMatcher(stops, include)
    so_far, streamed, match = "", "", None
    for piece in pieces:
        so_far += piece
        match = matcher.find(so_far, len(piece))
        if match is not None:
            break
        visible = len(so_far) - matcher.holdback
        assert visible >= len(streamed)  # the visible text only grows
        streamed = so_far[:visible]

    if match is None:
        final = so_far
    else:
        # Reference: all occurrences in the text seen so far (none existed one piece earlier).
        occurrences = [(i, len(s), s) for s in stops for i in range(len(so_far)) if so_far.startswith(s, i)]
        index, length, stop_str = min(occurrences)
        assert match == (stop_str, index + length if include else index)
        final = so_far[: match[1]]
        assert include or not any(s in final for s in stops)
    assert final.startswith(streamed)
