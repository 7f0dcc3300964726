"""Synthetic benchmark prompts: `random`, `prefix-repetition` and `multi-tenant`, as token ids.

Prompts are built from token ids so their lengths are exact. The ids come from a pool of
ordinary tokens: the whole vocabulary less special tokens when a local tokenizer is given, else
the ids the server's /tokenize returns for a built-in English text (this works against any
server with /tokenize, whatever its tokenizer). Text prompts, needed for chat, are the ids
decoded by the same tokenizer.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import numpy as np

# Varied everyday words: their tokens make a pool of ordinary, non-special ids.
_POOL_TEXT = """
The quick brown fox jumps over the lazy dog while seven curious children watch from a small
wooden bridge. Engineers measure throughput, latency and memory; gardeners water tomatoes,
roses and tall sunflowers every morning. Mountains, rivers, oceans and deserts cover our planet,
which orbits a yellow star among billions of others. She wrote 42 letters in March, June and
October, then painted the kitchen blue, green and orange. Scientists discovered that honey
never spoils; musicians practise scales, chords and melodies for hours. A careful reader
notices punctuation: commas, semicolons, question marks? Exclamation marks! Numbers like 3.14,
2048 and 1,000,000 appear in reports about economics, history, chemistry and astronomy. Bakers
knead dough before sunrise; pilots check weather, fuel and maps before every flight across
the northern sea. Libraries keep novels, poems, encyclopedias, newspapers and ancient scrolls.
"""


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


class TokenSource(Protocol):
    """Where the token-id pool comes from and how ids become text."""

    async def token_pool(self) -> list[int]: ...

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, token_ids: list[int]) -> str: ...


class LocalTokenSource:
    """A Hugging Face tokenizer on disk (`--tokenizer PATH`)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    async def token_pool(self) -> list[int]:
        special = set(self.tokenizer.all_special_ids)
        return [i for i in range(len(self.tokenizer)) if i not in special]

    async def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


class ServerTokenSource:
    """The server's own /tokenize and /detokenize endpoints."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, headers: dict[str, str]):
        self.session = session
        self.base_url = base_url
        self.model = model
        self.headers = headers

    async def _post(self, path: str, body: dict) -> dict:
        async with self.session.post(self.base_url + path, json=body, headers=self.headers) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:300]
                raise RuntimeError(
                    f"{path} answered HTTP {resp.status}: {detail}. The server must support "
                    "/tokenize and /detokenize, or pass --tokenizer PATH to tokenize locally."
                )
            return await resp.json()

    async def token_pool(self) -> list[int]:
        body = {"model": self.model, "prompt": _POOL_TEXT, "add_special_tokens": False}
        tokens = (await self._post("/tokenize", body))["tokens"]
        pool = sorted(set(tokens))
        if len(pool) < 16:
            raise RuntimeError(f"/tokenize gave only {len(pool)} distinct ids for the pool text")
        return pool

    async def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return (await self._post("/tokenize", body))["tokens"]

    async def decode(self, token_ids: list[int]) -> str:
        body = {"model": self.model, "tokens": token_ids}
        return (await self._post("/detokenize", body))["prompt"]


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds [floor(L(1-r)), ceil(L(1+r))], at least 1 (vLLM's definition)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def random_requests(
    pool: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: np.random.Generator,
) -> list[SampleRequest]:
    """Prompts of uniform random tokens with lengths drawn uniformly around the targets."""
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    out_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    pool_arr = np.asarray(pool)
    return [
        SampleRequest(rng.choice(pool_arr, size=int(n)).tolist(), int(n), int(m))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


def prefix_repetition_requests(
    pool: list[int],
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    rng: np.random.Generator,
) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes, each followed by a unique random suffix, in shuffled order."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix-repetition prompts need prefix_len + suffix_len >= 1")
    pool_arr = np.asarray(pool)
    prefixes = [rng.choice(pool_arr, size=prefix_len).tolist() for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prompt = prefixes[i % num_prefixes] + rng.choice(pool_arr, size=suffix_len).tolist()
        requests.append(SampleRequest(prompt, len(prompt), output_len))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def multi_tenant_requests(
    pool: list[int],
    num_prompts: int,
    num_tenants: int,
    system_len_range: tuple[int, int],
    user_len: int,
    output_len: int,
    rng: np.random.Generator,
) -> list[SampleRequest]:
    """Many tenants, many users each: every tenant has its own system prompt (a length drawn
    uniformly in `system_len_range`), every request is one tenant's system prompt followed by a
    user message of its own; tenants drawn uniformly, requests in random order. The router's case:
    which replica holds which tenant's prefix (SGLang's multi-tenant benchmark)."""
    low, high = system_len_range
    if num_tenants < 1 or not 1 <= low <= high or user_len < 1:
        raise ValueError(
            f"multi-tenant needs >= 1 tenant, 1 <= system length min <= max and a user length >= 1; got "
            f"{num_tenants} tenants, system lengths {low}..{high}, user length {user_len}"
        )
    pool_arr = np.asarray(pool)
    systems = [rng.choice(pool_arr, size=int(rng.integers(low, high + 1))).tolist() for _ in range(num_tenants)]
    tenants = rng.integers(0, num_tenants, size=num_prompts)
    requests = []
    for tenant in tenants:
        prompt = systems[int(tenant)] + rng.choice(pool_arr, size=user_len).tolist()
        requests.append(SampleRequest(prompt, len(prompt), output_len))
    return requests


async def to_text_prompts(requests: list[SampleRequest], source: TokenSource, concurrency: int = 16) -> None:
    """Replace token-id prompts by their text, in place (for endpoints that only take text)."""
    limit = asyncio.Semaphore(concurrency)

    async def convert(req: SampleRequest) -> None:
        if isinstance(req.prompt, list):
            async with limit:
                req.prompt = await source.decode(req.prompt)

    await asyncio.gather(*(convert(r) for r in requests))
