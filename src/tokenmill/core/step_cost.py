"""What a step costs, learned from the steps the engine ran: seconds ≈ overhead + per_token × tokens.

The `slo` policy predicts from it how long the prefills ahead of a waiting request will take. A
least-squares line over the recent steps, with older steps forgotten geometrically so the model
follows the load (a batch that grows makes each token dearer). Pure Python, O(1) a step.
"""

from __future__ import annotations

import time
from collections import deque


class StepCostModel:
    def __init__(self, decay: float = 0.98, min_steps: int = 8, skip_steps: int = 0) -> None:
        """`decay`: the weight each older step keeps per newer one; `min_steps`: steps seen before
        predictions are trusted (before that `ready` is False); `skip_steps`: the first steps
        observed are left out of the fit (a new engine's first steps are cold)."""
        self.decay = decay
        self.min_steps = min_steps
        self.skip_steps = skip_steps
        self.num_steps = 0
        # Decayed sums for the weighted least-squares fit of seconds on tokens.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def observe(self, num_tokens: int, seconds: float) -> None:
        if self.skip_steps:
            self.skip_steps -= 1
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + num_tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xy = self._xy * d + num_tokens * seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float]:
        """(seconds per step, seconds per token), both >= 0; (0, 0) before any step."""
        if self._w == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(mean_x * mean_x, 1.0):  # every step the same size: all of it per token
            per_token = mean_y / mean_x if mean_x > 0 else 0.0
            return 0.0, max(per_token, 0.0)
        per_token = (self._xy / self._w - mean_x * mean_y) / var_x
        if per_token < 0.0:  # noise: a line that falls with more tokens means nothing
            return max(mean_y, 0.0), 0.0
        overhead = mean_y - per_token * mean_x
        if overhead < 0.0:
            return 0.0, mean_y / mean_x if mean_x > 0 else 0.0
        return overhead, per_token

    def seconds_for(
        self, num_tokens: int, token_budget: int, tokens_per_step_besides: int = 0, prefill_cap: int = 0
    ) -> float:
        """Predicted time to compute `num_tokens` of prefill in steps of at most `token_budget`
        tokens, each step also carrying `tokens_per_step_besides` (the running batch's decodes).
        `prefill_cap` (max_prefill_tokens_while_decoding; 0: none) bounds a step's prefill while
        anything decodes."""
        if num_tokens <= 0:
            return 0.0
        overhead, per_token = self.coefficients()
        room = max(token_budget - tokens_per_step_besides, 1)
        if prefill_cap and tokens_per_step_besides:
            room = min(room, prefill_cap)
        num_steps = -(-num_tokens // room)
        return num_steps * (overhead + per_token * tokens_per_step_besides) + per_token * num_tokens


class StepTimer:
    """Durations of the scheduler's steps, from the scheduler's own calls: a step starts when it
    is scheduled or when the previous one's results came back, whichever is later (async
    scheduling schedules step N+1 while step N runs), and ends when its results come back."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._scheduled_at: deque[float] = deque()
        self._last_result = 0.0

    def scheduled(self) -> None:
        self._scheduled_at.append(self.clock())

    def finished(self) -> float | None:
        """Seconds the step whose results just came back took; None without a matching schedule."""
        now = self.clock()
        if not self._scheduled_at:
            return None
        started = max(self._scheduled_at.popleft(), self._last_result)
        self._last_result = now
        return now - started


class PrefillDecodeCostModel:
    """seconds ≈ overhead + per_prefill_token × prefill tokens + per_decode_row × decode rows.

    StepCostModel's one slope cannot tell the two kinds of rows apart, and on the CPU they differ
    (a decoding row also pays its attention over the whole context, the lm_head and sampling: ~2x
    a prompt token's cost on the default model), so a step's time is predicted from both counts.
    A weighted least-squares plane over the recent steps, older ones forgotten geometrically, with
    a small ridge so that steps of one fixed mix (a steady state) keep the coefficients finite. Pure
    Python, O(1) a step."""

    def __init__(self, decay: float = 0.99, min_steps: int = 8, skip_steps: int = 0, ridge: float = 1e-3) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.skip_steps = skip_steps
        self.ridge = ridge  # relative to the mean squared counts: a prior pulling slopes to 0, weakly
        self.num_steps = 0
        # Decayed sums: weight, x1 (prefill), x2 (decode), y, and their products.
        self._w = self._p = self._d = self._y = 0.0
        self._pp = self._pd = self._dd = self._py = self._dy = 0.0
        self._coefficients: tuple[float, float, float] | None = None

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        if self.skip_steps:
            self.skip_steps -= 1
            return
        k = self.decay
        p, d = float(prefill_tokens), float(decode_rows)
        self._w = self._w * k + 1.0
        self._p = self._p * k + p
        self._d = self._d * k + d
        self._y = self._y * k + seconds
        self._pp = self._pp * k + p * p
        self._pd = self._pd * k + p * d
        self._dd = self._dd * k + d * d
        self._py = self._py * k + p * seconds
        self._dy = self._dy * k + d * seconds
        self.num_steps += 1
        self._coefficients = None

    def coefficients(self) -> tuple[float, float, float]:
        """(seconds per step, per prefill token, per decode row), each >= 0; zeros before any step."""
        if self._coefficients is not None:
            return self._coefficients
        if self._w == 0.0:
            return 0.0, 0.0, 0.0
        w = self._w
        mp, md, my = self._p / w, self._d / w, self._y / w
        # Centred (co)variances: the overhead drops out of the 2 x 2 system for the slopes.
        spp = self._pp / w - mp * mp
        sdd = self._dd / w - md * md
        spd = self._pd / w - mp * md
        spy = self._py / w - mp * my
        sdy = self._dy / w - md * my
        spp += self.ridge * (self._pp / w + 1.0)
        sdd += self.ridge * (self._dd / w + 1.0)
        det = spp * sdd - spd * spd
        if det <= 0.0:
            b = c = 0.0
        else:
            b = (spy * sdd - sdy * spd) / det
            c = (sdy * spp - spy * spd) / det
        # A negative slope is noise (more rows never make a step cheaper): refit the other alone.
        if b < 0.0:
            b, c = 0.0, max(sdy / sdd, 0.0) if sdd > 0.0 else 0.0
        elif c < 0.0:
            b, c = max(spy / spp, 0.0) if spp > 0.0 else 0.0, 0.0
        a = max(my - b * mp - c * md, 0.0)
        self._coefficients = (a, b, c)
        return self._coefficients

    def seconds(self, prefill_tokens: int, decode_rows: int) -> float:
        a, b, c = self.coefficients()
        return a + b * prefill_tokens + c * decode_rows

    def prefill_tokens_within(self, seconds: float, decode_rows: int) -> int:
        """The most prefill tokens a step with `decode_rows` decodes may carry and still be
        predicted to take at most `seconds` (0 if the decodes alone do not fit; a large number if
        prompt tokens look free)."""
        a, b, c = self.coefficients()
        left = seconds - a - c * decode_rows
        if left <= 0.0:
            return 0
        if b <= 0.0:
            return 1 << 30
        return int(left / b)
