"""`bench serve --dataset-name multi-tenant`: tenants' system prompts shared by many users."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest

from tokenmill.bench import serve
from tokenmill.bench.datasets import multi_tenant_requests


def test_every_request_is_a_tenants_system_prompt_then_its_own_user_message() -> None:
    requests = multi_tenant_requests(list(range(3, 500)), 60, 4, (40, 80), 8, 5, np.random.default_rng(0))
    prompts = [r.prompt for r in requests]
    assert len(prompts) == 60 and all(r.expected_output_len == 5 for r in requests)
    systems = {tuple(p[:-8]) for p in prompts}
    assert len(systems) == 4 and all(40 <= len(s) <= 80 for s in systems)
    assert len({tuple(p[-8:]) for p in prompts}) == 60  # every user message is its own
    with pytest.raises(ValueError, match="system lengths 80..40"):
        multi_tenant_requests([1, 2], 4, 2, (80, 40), 8, 5, np.random.default_rng(0))


def test_the_bench_flags_build_the_workload() -> None:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(
        ["--dataset-name", "multi-tenant", "--num-prompts", "10", "--multi-tenant-num-tenants", "2",
         "--multi-tenant-system-len", "20,30", "--multi-tenant-user-len", "4", "--multi-tenant-output-len", "3"]
    )  # fmt: skip

    class Pool:
        async def token_pool(self) -> list[int]:
            return list(range(3, 300))

    requests = asyncio.run(serve.build_requests(args, Pool()))  # type: ignore[arg-type]
    assert len(requests) == 10 and all(24 <= r.prompt_len <= 34 and r.expected_output_len == 3 for r in requests)
    assert len({tuple(r.prompt[:20]) for r in requests}) == 2
    args.multi_tenant_system_len = "400"
    with pytest.raises(ValueError, match="--multi-tenant-system-len must be MIN,MAX"):
        asyncio.run(serve.build_requests(args, Pool()))  # type: ignore[arg-type]
