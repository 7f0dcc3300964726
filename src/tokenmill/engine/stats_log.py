"""The periodic stats line of `tokenmill serve` (every TOKENMILL_LOG_STATS_INTERVAL s, default 10;
`--disable-log-stats` turns it off), as vLLM's:

  Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 1510.0 tokens/s, Running: 12 reqs,
  Waiting: 0 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.0%

Throughputs are over the interval just ended: prompt tokens are counted when a sequence's first
token arrives (its prompt less what the prefix cache held: what the engine computed), generated
tokens as they arrive. Running / waiting / KV usage are the engine's latest report; the prefix
hit rate is over the interval's lookups (all time until the first lookup). An idle server logs
one line when it goes idle, then stays quiet until work comes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from tokenmill.core.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the stats log interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_time = time.monotonic()
        self._last_prefix = (0.0, 0.0)  # prefix-cache (queries, hits) totals at the last line
        self._was_idle = False

    def output(self, out: EngineCoreOutput, prompt_tokens: int) -> None:
        """Counts one engine output of a sequence whose prompt has `prompt_tokens` tokens."""
        if out.queue_time is not None:  # set on a sequence's first output only
            self._prompt_tokens += max(prompt_tokens - out.num_cached_tokens, 0)
        self._generation_tokens += len(out.new_token_ids)

    def line(self, stats: Mapping[str, float], now: float) -> str | None:
        """The line for the interval ending `now` (None while idle), and a new interval begins."""
        seconds = max(now - self._last_time, 1e-9)
        prompt_tps = self._prompt_tokens / seconds
        generation_tps = self._generation_tokens / seconds
        running = int(stats.get("num_running", 0))
        waiting = int(stats.get("num_waiting", 0))
        queries = float(stats.get("prefix_cache_queries", 0.0))
        hits = float(stats.get("prefix_cache_hits", 0.0))
        new_queries = queries - self._last_prefix[0]
        new_hits = hits - self._last_prefix[1]
        hit_rate = new_hits / new_queries if new_queries > 0 else (hits / queries if queries > 0 else 0.0)
        idle = not (self._prompt_tokens or self._generation_tokens or running or waiting)
        quiet = idle and self._was_idle
        self._prompt_tokens = self._generation_tokens = 0
        self._last_time = now
        self._last_prefix = (queries, hits)
        self._was_idle = idle
        if quiet:
            return None
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
            f"{generation_tps:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * float(stats.get('kv_cache_usage', 0.0)):.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
        )

    async def run(self, engine_stats: Callable[[], Mapping[str, float]]) -> None:
        """Logs a line every interval until cancelled; `engine_stats` gives the engine's latest report."""
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line(engine_stats(), time.monotonic())
            if text is not None:
                logger.info("%s", text)
