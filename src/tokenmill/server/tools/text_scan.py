"""Small text helpers the streaming parsers share: held-back marker prefixes, content emission."""

from __future__ import annotations


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after `pos` (len(text) if none)."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def partial_marker_len(text: str, *markers: str) -> int:
    """How many trailing characters of `text` could be the start of one of `markers`.

    A stream holds those back: "<tool" may yet become "<tool_call>", and must not go out as
    content before the next delta decides.
    """
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def text_before_marker(text: str, pos: int, marker: str, final: bool) -> tuple[str, int, bool]:
    """What a stream may release from `pos` while it looks for `marker`: (the text surely before
    it, where that text ends, whether the marker starts there). Without the marker, a tail that
    could still become it is held back unless the output is final."""
    start = text.find(marker, pos)
    if start >= 0:
        return text[pos:start], start, True
    end = len(text) - (0 if final else partial_marker_len(text[pos:], marker))
    return text[pos:end], end, False


def finish_content(parts: list[str], has_calls: bool) -> str | None:
    """The non-streaming content rule, kept equal to what ContentEmitter streams.

    Without calls the output is content verbatim. With calls, the text outside them counts,
    less trailing whitespace (the newlines a model puts between and after calls are no answer).
    """
    text = "".join(parts)
    if has_calls:
        text = text.rstrip()
    return text or None


class ContentEmitter:
    """Streams content while holding back trailing whitespace until more text follows.

    Held whitespace goes out in front of the next non-blank text; at the end it goes out only
    if no call was made, which is exactly `finish_content`'s rule.
    """

    def __init__(self) -> None:
        self._pending = ""
        self.out: list[str] = []

    def add(self, text: str) -> None:
        if not text:
            return
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept) :]
        if kept:
            self.out.append(kept)

    def finish(self, has_calls: bool) -> None:
        if self._pending and not has_calls:
            self.out.append(self._pending)
        self._pending = ""

    def take(self) -> str | None:
        text = "".join(self.out)
        self.out.clear()
        return text or None
