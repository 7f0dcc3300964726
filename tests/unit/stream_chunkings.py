"""Ways to cut one recorded output into stream deltas, and folding a stream's deltas back up."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any


def chunkings(text: str, seed: int = 0, random_cuts: int = 12) -> Iterator[list[str]]:
    """Whole; one character at a time; two pieces at every split point; random sizes (1-8)."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(random_cuts):
        pieces, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 8)
            pieces.append(text[pos : pos + step])
            pos += step
        yield pieces


def run_stream(stream: Any, pieces: list[str]) -> list[Any]:
    return [stream.feed(piece) for piece in pieces] + [stream.finish()]


def fold_tool_deltas(deltas: list[Any]) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, [(name, parsed arguments)]) from StreamDeltas, checking the OpenAI delta rules:
    a call's first delta has its id and name, later ones neither."""
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.id and d.name, f"first delta of call {d.index} lacks id or name: {d}"
                assert d.index == len(calls), "calls start in index order"
                calls[d.index] = {"name": d.name, "arguments": d.arguments or "", "id": d.id}
            else:
                assert d.id is None and d.name is None, f"call {d.index} named twice: {d}"
                calls[d.index]["arguments"] += d.arguments or ""
    ids = [c["id"] for c in calls.values()]
    assert len(set(ids)) == len(ids)
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def fold_extracted(extracted: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    return extracted.content, [(c.name, json.loads(c.arguments)) for c in extracted.calls]
