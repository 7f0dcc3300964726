"""The torch-free side of the step contract: a SchedulerOutput survives msgpack as it is, and the
sampling flags every layer reads are derived in one place."""

from __future__ import annotations

import msgspec
import pytest

from tests.unit.test_scheduler import Harness, make_request
from tokenmill.core.outputs import SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def test_a_real_scheduler_output_round_trips_through_msgpack() -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
    h.add(make_request("a", 9, max_tokens=12, temperature=0.5, seed=3, stop=["x"], eos=(2,)))
    h.add(make_request("b", 6, max_tokens=12, repetition_penalty=1.2, prompt_logprobs=1))
    h.add(make_request("c", 5, max_tokens=12))
    kinds = set()
    for _ in range(100):
        if not h.scheduler.has_unfinished_requests():
            break
        so = h.scheduler.schedule()
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
        assert decoded == so and list(decoded.num_scheduled_tokens) == list(so.num_scheduled_tokens)
        kinds |= {"new"} if so.scheduled_new_reqs else set()
        kinds |= {"cached"} if so.scheduled_cached_reqs.request_ids else set()
        kinds |= {"new blocks"} if so.scheduled_cached_reqs.new_block_ids else set()
        kinds |= {"preempted"} if so.preempted_req_ids else set()
        kinds |= {"finished"} if so.finished_req_ids else set()
        kinds |= {"resumed"} if any(new.output_token_ids for new in so.scheduled_new_reqs) else set()
        h.record(h.scheduler.update_from_output(decoded, h.runner.execute(decoded)))
        h.scheduler.check_invariants()
    assert kinds == {"new", "cached", "new blocks", "preempted", "finished", "resumed"}


def test_the_core_package_stays_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import tokenmill.core.scheduler, tokenmill.core.outputs; "
        "assert 'torch' not in sys.modules, 'core imports torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("params", "has_penalties", "needs_output_history", "needs_host_history", "is_plain_greedy"),
    [
        ({"temperature": 0.0}, False, False, False, True),
        ({"temperature": 0.0, "logprobs": 0}, False, False, False, False),
        ({"temperature": 0.0, "min_tokens": 2}, False, True, True, False),
        ({"temperature": 0.0, "presence_penalty": 0.1}, True, True, True, False),
        ({"temperature": 0.0, "frequency_penalty": -0.1}, True, True, True, False),
        ({"temperature": 0.0, "repetition_penalty": 1.1}, True, True, True, False),
        ({"temperature": 0.0, "prompt_logprobs": 0}, False, False, True, True),
        ({"temperature": 0.8}, False, False, False, False),
    ],
)
def test_sampling_flags_are_derived_once(
    params, has_penalties, needs_output_history, needs_host_history, is_plain_greedy
) -> None:
    p = SamplingParams(**params)
    assert p.has_penalties == has_penalties
    assert p.needs_output_history == needs_output_history
    assert p.needs_host_history == needs_host_history
    assert p.is_plain_greedy == is_plain_greedy
