"""A disaggregation peer in its own process, for tests that kill it by pid mid-transfer.

    python -m tests.engine.kv_peer_process producer MODEL ADDRESS SEED COUNT
        prefills COUNT prompts (tests.engine.test_kv_transfer's generator) one by one, each under
        transfer id t<i>, printing "sent <i>" after each and pausing between them, then sleeps.
    python -m tests.engine.kv_peer_process consumer MODEL ADDRESS
        binds the address as a consumer engine, prints "ready", and sleeps (blocks queue for it).
"""

from __future__ import annotations

import random
import sys
import time

from tokenmill import LLM, SamplingParams


def prompts(vocab_size: int, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(40, 90))] for _ in range(count)]


def main(role: str, model: str, address: str, *rest: str) -> None:
    llm = LLM(model, device="cpu", max_model_len=256, kv_role=role, kv_transfer_address=address)
    if role == "consumer":
        print("ready", flush=True)
    else:
        seed, count = int(rest[0]), int(rest[1])
        for i, prompt in enumerate(prompts(llm.info.vocab_size, seed, count)):
            params = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_id=f"t{i}")
            llm.generate([{"prompt_token_ids": prompt}], params)
            print(f"sent {i}", flush=True)
            time.sleep(1.0)  # the test kills the process during one of these pauses
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main(*sys.argv[1:])
