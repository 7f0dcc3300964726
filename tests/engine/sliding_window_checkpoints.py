"""Tiny sliding-window checkpoints and a per-step check of the KV blocks they hold, shared by the
CPU engine tests (tests/engine/test_sliding_window_kv_cache.py) and the GPU ones
(tests/gpu/test_sliding_window_gpu.py).

- mistral: Mistral with a 32-token window on both layers: one sliding KV cache group.
- qwen2_hybrid: Qwen2 with `use_sliding_window` on layers 0 and 2 of 4: a full and a sliding
  group of two layers each, sharing the pool's two tensors.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import write_tiny_checkpoint
from tokenmill import LLM
from tokenmill.core.kv_cache_groups import max_live_sliding_blocks

WINDOW = 32
CHECKPOINTS = ("mistral", "qwen2_hybrid")


def write_sliding_checkpoint(path: Path, name: str, tokenizer) -> Path:
    if name == "mistral":
        return write_tiny_checkpoint(path, "mistral", tokenizer, seed=41, head_dim=16, sliding_window=WINDOW)
    if name == "qwen2_hybrid":
        return write_tiny_checkpoint(
            path, "qwen2", tokenizer, seed=42, num_hidden_layers=4, use_sliding_window=True,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        )  # fmt: skip
    raise ValueError(f"unknown sliding-window checkpoint {name!r}; expected one of {CHECKPOINTS}")


def random_prompts(vocab_size: int, count: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


class WindowBound:
    """Wraps the engine's scheduler.schedule(): after each, every scheduled request holds at most
    max_live_sliding_blocks(window, block_size, its tokens this step) blocks in each sliding group."""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.engine.scheduler
        self.max_live: dict[int, int] = {}  # group -> most blocks one request held there
        self.num_checks = 0
        schedule = self.scheduler.schedule

        def checked_schedule():  # noqa: ANN202 - SchedulerOutput
            output = schedule()
            self.check(output.num_scheduled_tokens)
            return output

        self.scheduler.schedule = checked_schedule

    def check(self, num_scheduled: dict[str, int]) -> None:
        kv = self.scheduler.kv
        for request_id, num_new in num_scheduled.items():
            live = kv.num_live_blocks(request_id)
            for group, window in enumerate(kv.windows):
                self.max_live[group] = max(self.max_live.get(group, 0), live[group])
                if window is not None:
                    bound = max_live_sliding_blocks(window, kv.block_size, num_new)
                    assert live[group] <= bound, (
                        f"{request_id} holds {live[group]} blocks in sliding group {group} "
                        f"computing {num_new} tokens; the window allows {bound}"
                    )
            self.num_checks += 1

    def sliding_groups(self) -> list[int]:
        return [g for g, w in enumerate(self.scheduler.kv.windows) if w is not None]
