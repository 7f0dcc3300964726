"""How many drafts each request gets next step: speculation must never make serving slower.

Verification costs a row per draft. Where decode is bound by reading the weights (few requests)
extra rows are nearly free; in a large batch they cost real compute, and drafts that get
rejected cost it for nothing. So:
- above `disable_by_batch_size` requests in a step, nobody gets drafts;
- each request keeps a moving average of its acceptance rate; below `min_acceptance_rate` it stops
  drafting for a cool-down that doubles each time it fails again (up to `MAX_COOLDOWN` steps), then
  probes with drafts once more (text that did not repeat may start to).
"""

from __future__ import annotations

from dataclasses import dataclass

# No drafts in a step with more requests than this, unless the config says otherwise: on a GPU a
# decode step stays bound by reading the weights up to a few dozen rows; on a CPU the matmuls
# turn compute bound much earlier.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"cuda": 32, "cpu": 8}

EMA_WEIGHT = 0.3  # of the newest step's acceptance rate
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 64


@dataclass(slots=True)
class _Acceptance:
    rate: float  # moving average; a new request starts at twice the threshold: two bad steps stop it
    cooldown: int = 0  # steps left without drafts
    next_cooldown: int = FIRST_COOLDOWN


class DraftPolicy:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int, min_acceptance_rate: float) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self._requests: dict[str, _Acceptance] = {}

    def drafting_allowed(self, batch_size: int) -> bool:
        return batch_size <= self.disable_by_batch_size

    def num_drafts(self, request_id: str) -> int:
        """Drafts to propose for the request's next step (0 while it cools down)."""
        state = self._requests.get(request_id)
        if state is None:
            return self.k
        if state.cooldown > 0:
            state.cooldown -= 1
            return 0
        return self.k

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of the request and kept `num_accepted`."""
        if num_drafts <= 0:
            return
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Acceptance(min(1.0, 2 * self.min_acceptance_rate))
        state.rate = (1 - EMA_WEIGHT) * state.rate + EMA_WEIGHT * (num_accepted / num_drafts)
        if state.rate < self.min_acceptance_rate:
            state.cooldown = state.next_cooldown
            state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)
            # The probe after the cool-down starts from the threshold: one poor step stops it again.
            state.rate = self.min_acceptance_rate
        elif state.rate >= 2 * self.min_acceptance_rate:
            state.next_cooldown = FIRST_COOLDOWN

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def disable_by_batch_size(configured: int | None, device_type: str) -> int:
    """The batch size above which nobody drafts: the config's, else the device's default."""
    return configured if configured is not None else DEFAULT_DISABLE_BY_BATCH_SIZE.get(device_type, 8)
