"""Stop strings, matched on the detokenized text across token boundaries.

After each detokenizer step the output processor calls `find(text, num_new_chars)`. Only the new
text, plus the `max_len - 1` characters before it, is searched: a stop string ending earlier
would have been found on an earlier call, and one split across tokens still lies in that window.

Streaming clients must never see the start of a stop string that is cut away later, so
`holdback` says how many trailing characters to withhold: the longest end of the text that is
the beginning of some stop string (0 when the stop string is kept in the output anyway).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if not stop or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {stop!r}")
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max(len(s) for s in self.stop)
        self.holdback = 0  # for the text of the last `find` call

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """The stop string that appears first (earliest start; the shorter on a tie) among those
        ending in the last `num_new_chars` characters of `text`, and the length of text to keep
        (up to its start, or its end when it is included in the output); None when there is none."""
        start = max(0, len(text) - num_new_chars - self.max_len + 1)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            index = text.find(s, start)
            if index != -1 and (best is None or (index, len(s)) < best[:2]):
                best = (index, len(s), s)
        if best is None:
            self.holdback = self.partial_match_len(text)
            return None
        self.holdback = 0
        index, length, stop_str = best
        return stop_str, index + length if self.include_stop_str_in_output else index

    def partial_match_len(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string (without being all of it)."""
        if self.include_stop_str_in_output:
            return 0
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
