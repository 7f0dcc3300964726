"""`serve --data-parallel-size 2`: two real engine-core processes on a tiny checkpoint behind one
frontend give the offline engine's greedy tokens, share the work, keep shared prefixes on one core
(its prefix cache hits), route aborts to the owning core, and die together."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.args import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.dp_client import DataParallelClient, merge_stats
from tokenmill.errors import EngineDeadError

BLOCK = 8
ARGS = {"device": "cpu", "max_model_len": 128, "block_size": BLOCK, "kv_cache_memory": 16 * 2**20}


def test_merge_stats_sums_counts_and_averages_pool_usage() -> None:
    merged = merge_stats([{"num_running": 2, "kv_cache_usage": 0.5, "x_count": 3}, {"num_running": 1, "kv_cache_usage": 0.1}])
    assert merged == {"num_running": 3.0, "kv_cache_usage": pytest.approx(0.3), "x_count": 3.0}


def test_two_engine_cores_serve_like_one(tiny_llama_dir) -> None:
    rng = random.Random(0)
    distinct = [[rng.randrange(3, 900) for _ in range(rng.randrange(10, 30))] for _ in range(6)]
    shared = [rng.randrange(3, 900) for _ in range(3 * BLOCK)]
    followers = [shared + [rng.randrange(3, 900) for _ in range(5)] for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = LLM(str(tiny_llama_dir), **ARGS).generate([{"prompt_token_ids": p} for p in distinct + followers], greedy)
    expected = [out.outputs[0].token_ids for out in offline]

    config = EngineArgs(model=str(tiny_llama_dir), **ARGS).create_engine_config(resolve_device=False)
    client = DataParallelClient(config, 2)

    async def final(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
        last = None
        async for out in engine.generate(rid, None, prompt, params, stream=False):
            last = out
        return last

    async def scenario() -> None:
        engine = AsyncEngine(config, client=client)
        await engine.start()
        try:
            outs = await asyncio.gather(*(final(engine, f"d{i}", p, greedy) for i, p in enumerate(distinct)))
            assert [o.outputs[0].token_ids for o in outs] == expected[:6]
            assert client.dispatched == [3, 3], client.dispatched  # concurrent and distinct: spread
            # One after the other, the shared prefix stays on one core, whose prefix cache then hits.
            before = list(client.dispatched)
            follow = [await final(engine, f"f{i}", p, greedy) for i, p in enumerate(followers)]
            assert [o.outputs[0].token_ids for o in follow] == expected[6:]
            grew = [after - b for after, b in zip(client.dispatched, before, strict=True)]
            assert sorted(grew) == [0, 3], grew
            assert [o.num_cached_tokens for o in follow[1:]] == [3 * BLOCK, 3 * BLOCK]

            # An abort reaches the owning core: its request stops running there.
            long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            task = asyncio.create_task(final(engine, "long", distinct[0], long))
            for _ in range(200):
                if engine.stats.get("num_running"):
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(200):
                if not engine.stats.get("num_running") and not any(
                    client.balancer.load_of(n).in_flight for n in client.names
                ):
                    break
                await asyncio.sleep(0.01)
            assert engine.stats["num_running"] == 0 and engine.stats["num_waiting"] == 0, engine.stats

            # One core dies: the engine is dead, new requests fail at once.
            pid = client.engine_pids[1]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                if engine.dead:
                    break
                await asyncio.sleep(0.05)
            assert engine.dead and "engine core 1 of 2" in engine.dead
            with pytest.raises(EngineDeadError):
                await final(engine, "after", distinct[0], greedy)
        finally:
            await engine.shutdown()
        assert all(core.engine_pid is None or core._process.poll() is not None for core in client.cores)

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_the_serve_flag_builds_one_frontend_over_n_cores(capsys) -> None:
    from tokenmill.cli import build_parser
    from tokenmill.server.launch import build_server

    server = build_server(build_parser().parse_args(["serve", "--device", "cpu", "--data-parallel-size", "3"]))
    client = server.tm_state.engine.client
    asyncio.run(server.tm_state.engine.shutdown())
    assert isinstance(client, DataParallelClient) and len(client.cores) == 3
    assert [core._env for core in client.cores] == [{"CUDA_VISIBLE_DEVICES": str(r)} for r in range(3)] or os.environ.get(
        "CUDA_VISIBLE_DEVICES"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--data-parallel-size", "0"])
    assert "--data-parallel-size: must be between 1 and 64, got '0'" in capsys.readouterr().err


def test_data_parallel_with_tensor_parallel_is_refused_naming_both() -> None:
    from tokenmill.cli import build_parser
    from tokenmill.server.launch import build_server

    args = ["serve", "--device", "cpu", "--data-parallel-size", "2", "--tensor-parallel-size", "3"]
    with pytest.raises(ValueError, match="--data-parallel-size > 1 with --tensor-parallel-size > 1"):
        build_server(build_parser().parse_args(args))
