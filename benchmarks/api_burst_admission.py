"""How long a burst of requests takes to get through the API server to the engine (CPU, no model).

    PYTHONPATH=src python benchmarks/api_burst_admission.py --requests 512 --prompt-len 512

The real API app (FastAPI, validation, admission, input processing, streaming) over the fake
engine of tests/server/fake_engine.py, driven in process through httpx's ASGI transport: every
request is sent at once with a token-id prompt; prints when each reached the engine (its
arrival_time stamp), median and last, from the moment the burst was sent. Run from the repo root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time


async def burst(num_requests: int, prompt_len: int) -> list[float]:
    import httpx
    from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state

    from tokenmill.server.api_server import create_app

    engine = FakeEngine(max_model_len=prompt_len + 64, num_kv_blocks=10**6, step_s=0.01)
    await engine.start()
    state = fake_server_state(engine)
    arrivals: list[float] = []
    make_request = engine.input_processor.make_request

    def stamped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        request = make_request(*args, **kwargs)
        arrivals.append(time.perf_counter())
        return request

    engine.input_processor.make_request = stamped
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=120) as client:

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": [5 + (7 * i + j) % 200 for j in range(prompt_len)], "max_tokens": 4,
                    "stream": True}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        sent = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(num_requests)))
    await engine.shutdown()
    return sorted(t - sent for t in arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-name", default=None, help="also write a result file to benchmarks/results/")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    import tokenmill
    from tokenmill.bench.results import write_result

    runs = [asyncio.run(burst(args.requests, args.prompt_len)) for _ in range(args.repeats)]
    metrics = {
        "arrival_median_ms": [round(1000 * statistics.median(r)) for r in runs],
        "arrival_last_ms": [round(1000 * r[-1]) for r in runs],
    }
    # The tree under test may not be the checkout's (PYTHONPATH=another/src): record which one ran.
    src = os.path.dirname(os.path.dirname(tokenmill.__file__))
    commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    config = {"requests": args.requests, "prompt_len": args.prompt_len, "tokenmill_src": src,
              "tokenmill_src_commit": commit.stdout.strip() or None}  # fmt: skip
    print(json.dumps(config | metrics))
    if args.result_name:
        print(write_result("api-burst-admission", config, metrics, name=args.result_name))


if __name__ == "__main__":
    main()
