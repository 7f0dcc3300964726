"""A bounded soak against the real server: mixed traffic and client-caused faults, then an audit.

The load and every check live in tests/reliability/soak.py (also a script for longer runs); this is
its CI-sized run (~40 s of load) on a tiny random checkpoint with small queue and KV limits, so
bursts meet admission control and the scheduler preempts.
"""

from __future__ import annotations

import asyncio
import signal

from tests.reliability.server_tools import process_tree, start_tiny_server, survivors
from tests.reliability.soak import DEFAULT_SERVER_ARGS, SoakConfig, run_soak

CI_SOAK = SoakConfig(duration_s=40.0, concurrency=10, burst_every_s=8.0, burst_size=40, seed=20251121)


def test_soak_every_request_ends_once_and_nothing_is_left(tmp_path, tiny_llama_dir):
    server = start_tiny_server(str(tmp_path), str(tiny_llama_dir), *DEFAULT_SERVER_ARGS)
    tree = process_tree(server.process.pid)
    try:
        report = asyncio.run(run_soak(server.base_url, CI_SOAK))
    finally:
        exit_code = server.stop(signal.SIGTERM, timeout=60)
    summary = report.summary()
    print(summary)
    assert not report.violations, summary

    # The mix really happened: every kind of request, and every kind of ending.
    kinds = {kind.split(":")[0] for kind in report.outcomes_by_kind}
    assert kinds >= {
        "stream", "nonstream", "stream_disconnect", "nonstream_disconnect",
        "deadline", "oversized", "bad_params", "burst",
    }, summary  # fmt: skip
    endings = {t for terminals in report.outcomes_by_kind.values() for t in terminals}
    assert endings >= {"completed", "client_disconnect", "error_status"}, summary
    assert report.outcomes_by_kind["stream_disconnect"].get("client_disconnect", 0) >= 10, summary
    assert report.outcomes_by_kind["oversized"] == {
        "error_status": report.outcomes_by_kind["oversized"]["error_status"]
    }
    assert report.finish_reasons.get("length", 0) >= 50, summary
    assert report.server_finished_by_reason.get("abort", 0) >= 10, summary  # disconnects were aborted
    assert report.server_finished_by_reason.get("error", 0) == 0, summary
    assert report.idle_after_drain == {"running": 0.0, "waiting": 0.0, "kv_cache_usage_perc": 0.0}

    assert exit_code == 0, server.log()
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"
