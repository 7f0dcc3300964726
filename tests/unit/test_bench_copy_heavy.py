"""The copy-heavy dataset: deterministic from its seed, every task kind, lengths in range, texts
that are what they say (the JSON parses, the CSV has its columns), and `bench serve` sends it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from tests.unit.test_bench_serve import FakeOpenAIServer, fake_server, parse_args  # noqa: F401
from tokenmill.bench import serve
from tokenmill.bench.copy_heavy import TASKS, copy_heavy_requests, task_prompt
from tokenmill.bench.datasets import SampleRequest


async def count_pieces(text: str) -> int:
    """A stand-in tokenizer: words, numbers and single punctuation marks."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def build(num_prompts: int, seed: int, **kwargs: int) -> list[SampleRequest]:
    return asyncio.run(copy_heavy_requests(num_prompts, seed, count_pieces, **kwargs))


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others() -> None:
    first, again, other = build(10, seed=3), build(10, seed=3), build(10, seed=4)
    assert [(r.prompt, r.prompt_len) for r in first] == [(r.prompt, r.prompt_len) for r in again]
    assert not {r.prompt for r in first} & {r.prompt for r in other}


def test_lengths_land_in_range_with_every_kind_and_the_output_len() -> None:
    requests = build(50, seed=0)
    lengths = [r.prompt_len for r in requests]
    assert all(128 <= n <= 512 for n in lengths), lengths
    assert max(lengths) - min(lengths) > 200  # spread over the range, not all at one end
    for r in requests:
        assert isinstance(r.prompt, str) and r.expected_output_len == 128
        assert r.prompt_len == asyncio.run(count_pieces(r.prompt))
    openings = {r.prompt.split()[0] for r in requests}
    assert openings == {"Rename", "Rewrite", "Extract", "Convert", "Copy"}  # the five kinds
    short = build(10, seed=1, min_input_len=200, max_input_len=260, output_len=32)
    assert all(200 <= r.prompt_len <= 260 and r.expected_output_len == 32 for r in short)


def test_more_items_extend_the_same_text() -> None:
    for kind in TASKS:
        shorter, longer = task_prompt(kind, 7, 5), task_prompt(kind, 7, 6)
        assert len(longer) > len(shorter)
        # Everything but the last item's closing lines is shared (the bisection relies on it).
        common = len(shorter) - 40
        assert longer[:common] == shorter[:common], kind


def test_the_texts_are_what_the_instructions_say() -> None:
    records = task_prompt("extract-json", 1, 12)
    array = json.loads(records[records.index("\n[") :])
    assert len(array) == 12 and {"name", "email", "city"} <= array[0].keys()
    rows = task_prompt("csv-to-markdown", 1, 9).split("\n\n", 1)[1].splitlines()
    assert len(rows) == 10 and all(len(row.split(",")) == 5 for row in rows)
    code = task_prompt("rename-code", 1, 14)
    old, new = re.findall(r"`(\w+)`", code)[:2]
    body = code.split("```python\n", 1)[1].removesuffix("\n```")
    compile(body, "<copy-heavy>", "exec")  # valid Python
    assert re.search(rf"\b{old}\b", body) and not re.search(rf"\b{new}\b", body)
    log = task_prompt("filter-log", 1, 30).split("\n\n", 1)[1].splitlines()
    assert len(log) == 30 and any(" ERROR " in line for line in log)
    story = task_prompt("replace-name", 1, 8)
    old_name = story.split("replacing the name ", 1)[1].split()[0]
    assert story.split("\n\n", 1)[1].count(old_name) >= 8
    with pytest.raises(ValueError, match="unknown copy-heavy task 'poem'"):
        task_prompt("poem", 0, 3)
    with pytest.raises(ValueError, match="0 < min <= max"):
        build(1, 0, min_input_len=300, max_input_len=200)


def test_bench_serve_sends_copy_heavy_chat_prompts(fake_server: FakeOpenAIServer, tmp_path: Path) -> None:  # noqa: F811
    args = parse_args(
        "--base-url", fake_server.base_url, "--endpoint", "/v1/chat/completions", "--dataset-name",
        "copy-heavy", "--num-prompts", "6", "--max-concurrency", "2", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "copy",
    )  # fmt: skip
    assert serve.main(args) == 0
    record = json.loads((tmp_path / "copy.json").read_text())
    assert record["config"]["dataset_name"] == "copy-heavy"
    assert record["config"]["copy_heavy_max_input_len"] == 512
    assert record["metrics"]["completed"] == 6
    contents = [p["messages"][0]["content"] for p in fake_server.payloads]
    assert all(p["max_completion_tokens"] == 128 for p in fake_server.payloads)
    # The fake server's /tokenize counts words: the prompt lengths were fitted with it.
    assert all(128 <= len(c.split()) <= 512 for c in contents)
    assert record["metrics"]["total_input_tokens"] == sum(len(c.split()) for c in contents)
