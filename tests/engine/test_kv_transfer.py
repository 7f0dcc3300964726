"""Disaggregated prefill / decode on the CPU: a producer engine prefills, ships its prompt blocks
over ZMQ (msgspec) to a consumer engine, which starts the same prompts from them. Output equals
colocated serving and transformers; a mismatched or corrupt transfer is refused; unclaimed blocks
expire; a producer without a consumer keeps serving; no engine leaks a block."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from tests.engine import kv_peer_process
from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_transfer import KVBlocksHeader, KVConsumer, KVLayout, blocks_message_frames

MAX_NEW = 6


def _prompts(vocab_size: int, count: int = 5) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(20, 90))] for _ in range(count)]


def _prefill(producer: LLM, prompts: list[list[int]]) -> None:
    producer.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))


def _decode(consumer: LLM, prompts: list[list[int]]):  # noqa: ANN202 - list[RequestOutput]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return consumer.generate([{"prompt_token_ids": p} for p in prompts], params)


def _wait_for_blocks(consumer: LLM, count: int) -> None:
    connector = consumer.engine.scheduler.kv_connector
    assert isinstance(connector, KVConsumer)
    deadline = time.monotonic() + 10
    while connector.blocks_received + connector.messages_refused < count and time.monotonic() < deadline:
        connector.poll()
        time.sleep(0.01)


def _engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", max_model_len=256, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_producer_to_consumer_equals_colocated(tiny_llama_dir, tmp_path, async_scheduling: bool) -> None:
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=address, async_scheduling=async_scheduling)
    producer = _engine(path, kv_role="producer", kv_transfer_address=address, async_scheduling=async_scheduling)
    prompts = _prompts(consumer.info.vocab_size)
    _prefill(producer, prompts)
    sent = producer.engine.get_stats()["kv_transfer_blocks_sent"]
    assert sent == sum((len(p) - 1) // 16 for p in prompts)
    _wait_for_blocks(consumer, sent)
    outputs = _decode(consumer, prompts)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0]
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # every full block came over
    stats = consumer.engine.get_stats()
    assert stats["kv_transfer_hits"] == sum(out.num_cached_tokens for out in outputs) > 0
    assert stats["kv_transfer_blocks_claimed"] == sent and stats["kv_transfer_messages_refused"] == 0
    for engine in (producer.engine, consumer.engine):
        engine.check_invariants()  # every block back in the free list
    assert consumer.engine.scheduler.kv_connector.num_unclaimed_blocks == 0


def test_a_transfer_from_another_layout_is_refused_and_the_prompt_computed(tiny_llama_dir, tmp_path) -> None:
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=address, block_size=32)
    producer = _engine(path, kv_role="producer", kv_transfer_address=address)  # block size 16
    prompts = _prompts(consumer.info.vocab_size, 2)
    _prefill(producer, prompts)
    _wait_for_blocks(consumer, 1)
    outputs = _decode(consumer, prompts)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0]
        assert out.num_cached_tokens == 0
    stats = consumer.engine.get_stats()
    assert stats["kv_transfer_messages_refused"] >= 1 and stats["kv_transfer_hits"] == 0
    consumer.engine.check_invariants()


def test_a_producer_without_a_consumer_keeps_serving(tiny_llama_dir, tmp_path) -> None:
    """The consumer is gone (nobody binds the address): sends are dropped, requests still finish."""
    producer = _engine(str(tiny_llama_dir), kv_role="producer", kv_transfer_address=f"ipc://{tmp_path}/nobody")
    prompts = _prompts(producer.info.vocab_size, 3)
    _prefill(producer, prompts)
    _prefill(producer, prompts)
    assert producer.engine.runner.kv_connector.blocks_dropped > 0
    producer.engine.check_invariants()


LAYOUT = KVLayout("m", 4, "float32", 1, (2, 4, 1, 2), 64)


def _consumer(tmp_path, clock) -> tuple[KVConsumer, zmq.Socket]:
    consumer = KVConsumer(f"ipc://{tmp_path}/c", LAYOUT, claim_timeout_s=5.0, max_bytes=3 * 64, clock=clock)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"ipc://{tmp_path}/c")
    return consumer, push


def _drain(consumer: KVConsumer, expected_messages: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        consumer.poll()
        if consumer.blocks_received + consumer.messages_refused >= expected_messages:
            return
        time.sleep(0.01)


def test_unclaimed_blocks_expire_and_the_buffer_is_bounded(tmp_path) -> None:
    now = [0.0]
    consumer, push = _consumer(tmp_path, lambda: now[0])
    try:
        header = KVBlocksHeader(LAYOUT, [b"k1", b"k2"], [[1, 2, 3, 4], [5, 6, 7, 8]])
        push.send_multipart(blocks_message_frames(header, bytes(128)))
        _drain(consumer, 2)
        assert consumer.num_unclaimed_blocks == 2
        now[0] = 10.0  # past the claim timeout
        consumer.poll()
        assert consumer.num_unclaimed_blocks == 0 and consumer.blocks_expired == 2
        keys = [bytes([i]) for i in range(5)]
        push.send_multipart(blocks_message_frames(KVBlocksHeader(LAYOUT, keys, [[1, 2, 3, 4]] * 5), bytes(5 * 64)))
        _drain(consumer, 7)
        assert consumer.num_unclaimed_blocks == 3  # 3 blocks of 64 bytes at most
        consumer.check_invariants()
    finally:
        push.close(0)
        consumer.close()


@pytest.mark.parametrize(
    "frames",
    [
        [b"not msgpack at all", bytes(64)],
        blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k"], [[1, 2, 3, 4]]), bytes(63)),  # short payload
        blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k"], [[1, 2, 3, 4]]), bytes(128)),  # long payload
        blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k", b"j"], [[1, 2, 3, 4]]), bytes(128)),  # keys != token lists
        blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k"], [[1, 2, 3]]), bytes(64)),  # a short token list
        blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k"], [[1, 2, 3, 4]]), bytes(64))[:1],  # no payload frame
        [*blocks_message_frames(KVBlocksHeader(LAYOUT, [b"k"], [[1, 2, 3, 4]]), bytes(64)), b"extra"],
        blocks_message_frames(
            KVBlocksHeader(KVLayout("other", 4, "float32", 1, (2, 4, 1, 2), 64), [b"k"], [[1, 2, 3, 4]]), bytes(64)
        ),
    ],
    ids=["undecodable", "short-payload", "long-payload", "keys-vs-tokens", "short-tokens", "one-frame", "three-frames", "other-model"],
)
def test_corrupt_or_mismatched_transfers_are_refused(tmp_path, frames: list[bytes]) -> None:
    consumer, push = _consumer(tmp_path, time.monotonic)
    try:
        push.send_multipart(frames)
        _drain(consumer, 1)
        assert consumer.messages_refused == 1 and consumer.num_unclaimed_blocks == 0
    finally:
        push.close(0)
        consumer.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_role": "producer"}, "needs kv_transfer_address"),
        ({"kv_transfer_address": "ipc:///tmp/x"}, "kv_role is not"),
        ({"kv_role": "consumer", "kv_transfer_address": "ipc:///tmp/x", "kv_offload_gb": 1}, "cannot be combined"),
        ({"kv_role": "consumer", "kv_transfer_address": "ipc:///tmp/x", "kv_claim_timeout": 0}, "kv_claim_timeout must"),
        ({"kv_role": "sideways", "kv_transfer_address": "ipc:///tmp/x"}, "kv_role must be one of"),
        ({"kv_role": "consumer", "kv_transfer_address": "ipc:///tmp/x", "kv_transfer_wait": -1}, "kv_transfer_wait must"),
        (
            {"kv_role": "consumer", "kv_transfer_address": "ipc:///tmp/x", "kv_transfer_wait": float("nan")},
            "kv_transfer_wait must",
        ),
    ],
)
def test_bad_kv_role_options_are_refused(kwargs: dict, message: str) -> None:
    from tokenmill.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model="x", **kwargs).create_engine_config(resolve_device=False)


def test_a_consumer_that_dies_between_transfers_leaves_the_producer_serving(tiny_llama_dir, tmp_path) -> None:
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=address)
    producer = _engine(path, kv_role="producer", kv_transfer_address=address)
    prompts = _prompts(consumer.info.vocab_size, 4)
    _prefill(producer, prompts[:2])
    _wait_for_blocks(consumer, 1)
    consumer.engine.scheduler.kv_connector.close()  # the consumer is gone
    time.sleep(0.2)
    _prefill(producer, prompts[2:])  # sends go nowhere; requests still finish
    producer.engine.check_invariants()
    assert producer.engine.get_stats()["kv_transfer_blocks_sent"] == sum((len(p) - 1) // 16 for p in prompts)


def test_a_consumer_address_in_use_is_refused_by_name() -> None:
    taken = zmq.Context.instance().socket(zmq.PULL)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind("tcp://127.0.0.1:*")
    try:
        address = taken.getsockopt(zmq.LAST_ENDPOINT).decode()
        with pytest.raises(ValueError, match="cannot bind kv_transfer_address"):
            KVConsumer(address, LAYOUT, claim_timeout_s=1.0, max_bytes=64)
    finally:
        taken.close(0)


def _params(max_tokens: int, transfer_id: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, kv_transfer_id=transfer_id)


def test_a_consumer_request_waits_for_its_transfer_instead_of_computing_whole(tiny_llama_dir, tmp_path) -> None:
    """The race: the consumer gets the requests before the producer has even started them. Each
    names its transfer, waits for it (holding no block) and still starts from every full block;
    a request without a transfer id, queued behind them, is not held up."""
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=address, kv_transfer_wait=30)
    producer = _engine(path, kv_role="producer", kv_transfer_address=address)
    prompts = _prompts(consumer.info.vocab_size, 3)
    results: dict[str, list] = {}
    start = time.monotonic()
    waiting = threading.Thread(
        target=lambda: results.setdefault(
            "out", consumer.generate([{"prompt_token_ids": p} for p in prompts], [_params(MAX_NEW, f"t{i}") for i in range(3)])
        )
    )  # fmt: skip
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()  # still waiting: nothing was sent
    producer.generate([{"prompt_token_ids": p} for p in prompts], [_params(1, f"t{i}") for i in range(3)])
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert time.monotonic() - start < 30  # released by the arrivals, not the wait timeout
    for prompt, out in zip(prompts, results["out"], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0]
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    stats = consumer.engine.get_stats()
    assert stats["kv_transfer_wait_timeouts"] == 0
    connector = consumer.engine.scheduler.kv_connector
    assert connector.num_waiting_requests == 0 and connector.num_unclaimed_blocks == 0
    producer.engine.check_invariants()
    consumer.engine.check_invariants()


def test_a_waiting_request_does_not_hold_up_others_and_gives_up_after_the_wait(tiny_llama_dir, tmp_path) -> None:
    """No producer ever sends: the named request is computed whole after --kv-transfer-wait; a
    request behind it without an id finishes first."""
    path = str(tiny_llama_dir)
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=f"ipc://{tmp_path}/kv", kv_transfer_wait=1.0)
    prompts = _prompts(consumer.info.vocab_size, 2)
    finished_order: list[str] = []
    engine = consumer.engine
    make = consumer.input_processor.make_request
    engine.add_request(make("named", prompts[0], _params(MAX_NEW, "never-sent")))
    engine.add_request(make("plain", prompts[1], _params(MAX_NEW, None)))
    outputs = {}
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished_order.append(out.request_id)
                outputs[out.request_id] = out
    assert finished_order == ["plain", "named"]
    assert outputs["named"].finish_reason == "length" and outputs["named"].num_cached_tokens == 0
    assert engine.get_stats()["kv_transfer_wait_timeouts"] == 1
    assert engine.scheduler.kv_connector.num_waiting_requests == 0
    engine.check_invariants()


def test_kv_transfer_id_without_a_kv_role_is_refused_by_name(tiny_llama_dir) -> None:
    llm = _engine(str(tiny_llama_dir))
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], _params(2, "t"))
    assert out.outputs[0].finish_reason == "error" and "kv_transfer_params" in (out.error or "")
    llm.engine.check_invariants()


def _peer(role: str, path: str, address: str, *rest: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engine.kv_peer_process", role, path, address, *rest],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _read_line(process: subprocess.Popen, expected: str) -> None:
    line = process.stdout.readline().strip()  # type: ignore[union-attr]
    assert line == expected, f"peer said {line!r} (exit code {process.poll()}), expected {expected!r}"


def test_a_producer_killed_mid_transfer_leaves_the_consumer_correct_and_leak_free(tiny_llama_dir, tmp_path) -> None:
    """The producer process (SIGKILL by pid) dies after its first transfer, before the others: the
    consumer's requests for the transfers that never come wait at most --kv-transfer-wait, then
    compute their prompts; the one that came starts from its blocks; all equal transformers."""
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _engine(path, kv_role="consumer", kv_transfer_address=address, kv_transfer_wait=1.5)
    producer = _peer("producer", path, address, "7", "4")
    try:
        _read_line(producer, "sent 0")
        _wait_for_blocks(consumer, 1)
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait(timeout=10)
    finally:
        if producer.poll() is None:
            os.kill(producer.pid, signal.SIGKILL)
    prompts = kv_peer_process.prompts(consumer.info.vocab_size, 7, 4)
    outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], [_params(MAX_NEW, f"t{i}") for i in range(4)])
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0]
    assert outputs[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16 > 0
    stats = consumer.engine.get_stats()
    assert stats["kv_transfer_wait_timeouts"] == sum(out.num_cached_tokens == 0 for out in outputs) >= 1
    connector = consumer.engine.scheduler.kv_connector
    assert connector.num_waiting_requests == 0
    consumer.engine.check_invariants()


def test_a_consumer_killed_mid_transfer_leaves_the_producer_serving_and_leak_free(tiny_llama_dir, tmp_path) -> None:
    """The consumer process (SIGKILL by pid) dies while the producer is sending: every producer
    request still finishes and every block goes back to the producer's pool."""
    path = str(tiny_llama_dir)
    address = f"ipc://{tmp_path}/kv"
    consumer = _peer("consumer", path, address)
    try:
        _read_line(consumer, "ready")
        producer = _engine(path, kv_role="producer", kv_transfer_address=address)
        prompts = _prompts(producer.info.vocab_size, 12)
        done: list = []
        sending = threading.Thread(target=lambda: done.extend(producer.generate(
            [{"prompt_token_ids": p} for p in prompts], [_params(1, f"t{i}") for i in range(len(prompts))]
        )))  # fmt: skip
        sending.start()
        time.sleep(0.05)
        os.kill(consumer.pid, signal.SIGKILL)
        sending.join(timeout=60)
        assert len(done) == len(prompts) and all(out.outputs[0].finish_reason == "length" for out in done)
        _prefill(producer, _prompts(producer.info.vocab_size, 3))  # the consumer is gone: still serving
        producer.engine.check_invariants()
    finally:
        if consumer.poll() is None:
            os.kill(consumer.pid, signal.SIGKILL)
        consumer.wait(timeout=10)


def test_waiting_for_a_transfer_is_bounded_released_by_its_id_and_forgotten_at_the_end(tmp_path) -> None:
    from tokenmill.core.request import Request

    now = [0.0]
    consumer, push = _consumer(tmp_path, lambda: now[0])
    consumer.wait_timeout_s = 2.0
    try:
        waiting = Request("a", [1] * 9, _params(4, "ta"))
        late = Request("b", [1] * 9, _params(4, "tb"))
        plain = Request("c", [1] * 9, _params(4, None))
        assert consumer.waits_for_transfer(waiting) and consumer.waits_for_transfer(late)
        assert not consumer.waits_for_transfer(plain)
        # An id-only message (no blocks) releases its request; a refused layout still does.
        other = KVLayout("other", 4, "float32", 1, (2, 4, 1, 2), 64)
        push.send_multipart(blocks_message_frames(KVBlocksHeader(other, [], [], ["ta"]), b""))
        deadline = time.monotonic() + 5
        while consumer.waits_for_transfer(waiting):
            assert time.monotonic() < deadline, "the transfer id never arrived"
            time.sleep(0.01)
        assert consumer.messages_refused == 1
        now[0] = 1.0
        assert consumer.waits_for_transfer(late)
        now[0] = 2.5  # past its wait: it computes, counted once
        assert not consumer.waits_for_transfer(late) and not consumer.waits_for_transfer(late)
        assert consumer.transfers_timed_out == 1
        preempted = Request("d", [1] * 9, _params(4, "td"))
        preempted.num_cached_tokens = 0  # it started once: it never waits again
        assert not consumer.waits_for_transfer(preempted)
        for request in (waiting, late, plain, preempted):
            consumer.request_finished(request, [])
        assert consumer.num_waiting_requests == 0
        consumer.check_invariants()
    finally:
        push.close(0)
        consumer.close()


def test_a_send_still_queued_keeps_its_bytes_while_the_next_is_gathered(tmp_path) -> None:
    """The sender reuses a host buffer only after ZMQ has sent it. The consumer reads nothing until
    all seven 8 MiB sends are made (and holds at most one message), so later sends find earlier
    buffers still queued: they must take fresh ones, and every message keeps its own bytes."""
    import torch

    from tokenmill.core.kv_connector_metadata import KVSendMetadata
    from tokenmill.worker.kv_connector import transfer
    from tokenmill.worker.kv_connector.transfer import KVSenderWorker, kv_layout

    pool = [torch.randn(2, 8, 16, 8, 512) for _ in range(2)]
    layout = kv_layout("m", 16, pool)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.setsockopt(zmq.RCVBUF, 1 << 16)
    pull.bind(f"ipc://{tmp_path}/s")
    sender = KVSenderWorker(pool, layout, f"ipc://{tmp_path}/s")
    try:
        time.sleep(0.2)  # let the PUSH socket connect (IMMEDIATE drops sends before that)
        blocks = list(range(8))
        sends = []
        for round_ in range(transfer.MAX_PINNED_SEND_BUFFERS + 3):  # past the kept buffers: one-off ones
            keys = [f"{round_}-{i}".encode() for i in blocks]
            sender.start_load_kv(KVSendMetadata(blocks, keys, [[1] * 16] * 8, [f"t{round_}"]))
            sends.append(b"".join(b"".join(t[:, i].numpy().tobytes() for t in pool) for i in blocks))
            for t in pool:
                t.add_(1.0)  # the blocks change before the earlier sends have left
        assert sender.blocks_dropped == 0
        kept = len(sender._buffers)  # noqa: SLF001
        assert 2 <= kept <= transfer.MAX_PINNED_SEND_BUFFERS  # some send found the others' queued
        for sent in sends:
            header, payload = pull.recv_multipart()
            assert payload == sent
    finally:
        sender.release()
        pull.close(0)


def test_claimed_payloads_side_by_side_in_one_frame_copy_as_one_run() -> None:
    """The consumer worker copies a run of blocks adjacent in one received buffer at once; blocks
    out of order, from another buffer or not adjacent start new runs, and the bytes stay in order."""
    from tokenmill.worker.kv_connector.transfer import _contiguous_runs

    frame = memoryview(bytearray(range(256)) * 4)
    blocks = [frame[i * 64 : (i + 1) * 64] for i in range(16)]
    payloads = [blocks[0], blocks[1], blocks[2], blocks[5], blocks[6], memoryview(b"x" * 64), blocks[7], blocks[3]]
    runs = _contiguous_runs(payloads, 64)
    assert [(first, len(region) // 64) for first, region in runs] == [(0, 3), (3, 2), (5, 1), (6, 1), (7, 1)]
    assert b"".join(region.tobytes() for _, region in runs) == b"".join(p.tobytes() for p in payloads)
