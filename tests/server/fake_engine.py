"""The real AsyncEngine with its engine process replaced by a scripted in-process core.

Everything on the API side is real — input and output processors, request fan-out over n,
queues, aborts, metrics callbacks, msgpack encoding of every message, the core-process client's
watchdog — only the engine process is fake (FakeCoreClient sends to a FakeCore instead of a
socket): each step gives every running sequence the next token of a fixed reply, then EOS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import EngineCoreOutput, TokenLogprobs
from tokenmill.core.request_timeline import RequestTimeline
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core_process import STATS_INTERVAL_S
from tokenmill.engine.core_process_client import DEFAULT_HANG_TIMEOUT_S, CoreProcessClient
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineCoreRequest,
    EngineInfo,
    EngineMessage,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.metrics import ServerMetrics
from tokenmill.server.state import ServerState

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Multi-byte characters split over byte tokens exercise the incremental detokenizer.
REPLY = " The quick brown fox jumps. Ünïcode 你好!"
BLOCK_SIZE = 4
MODEL = "tiny"  # the served model name of the servers built on the fake engine


def fake_server_state(
    engine: FakeEngine, *, model_names: list[str] | None = None, **state_kwargs
) -> ServerState:
    """A ServerState over the fake engine (ready unless told otherwise), its reports wired into
    the metrics as `tokenmill serve` wires them."""
    names = model_names or [MODEL]
    state_kwargs.setdefault("ready", True)
    state = ServerState(
        engine=engine,
        model_names=names,
        model_root="/models/tiny",
        metrics=ServerMetrics(names[0]),
        **state_kwargs,
    )
    state.attach_engine()
    return state


async def wait_until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte) with two special tokens and a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class _Seq:
    request: EngineCoreRequest
    num_generated: int = 0
    started: bool = False
    timeline: RequestTimeline | None = None  # as the real engine keeps one, and sends it at the end


class FakeCore:
    """Plays the engine process: takes client messages, and each step emits one token per sequence."""

    def __init__(self, client: FakeCoreClient, reply_ids: list[int], eos_id: int) -> None:
        self.client = client
        self.reply_ids = reply_ids
        self.eos_id = eos_id
        self.running: dict[str, _Seq] = {}
        self.added: list[str] = []
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.pending: list[EngineCoreOutput] = []
        self.paused = False
        self.steps = 0
        self.invariant_error: str | None = None  # what check_invariants reports, if anything
        # Called each step with (request, tokens generated so far) for every running sequence: a
        # message ends that sequence with finish_reason "error", as the engine ends one whose
        # logits went NaN or whose step failed; None lets it run on.
        self.fail_when: Callable[[EngineCoreRequest, int], str | None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)

    def receive(self, message: object) -> None:
        if isinstance(message, AddRequests):
            for req in message.requests:
                self.added.append(req.request_id)
                self.requests.append(req)
                timeline = RequestTimeline(
                    arrival=req.arrival_time, received=time.monotonic(), prompt_tokens=len(req.prompt_token_ids)
                )
                self.running[req.request_id] = _Seq(req, timeline=timeline)
        elif isinstance(message, AbortRequests):
            for rid in message.request_ids:
                seq = self.running.pop(rid, None)
                if seq is not None:
                    self.aborted.append(rid)
                    out = EngineCoreOutput(rid, finish_reason="abort")
                    if seq.timeline is not None:
                        seq.timeline.finished = time.monotonic()
                        out.timeline = seq.timeline
                    self.pending.append(out)
        elif isinstance(message, UtilityCall):
            if message.method == "check_invariants" and self.invariant_error:
                self._deliver(UtilityResult(message.call_id, error=self.invariant_error))
            else:
                self._deliver(UtilityResult(message.call_id, result=self.stats()))
        elif isinstance(message, Shutdown):
            self.paused = True

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.running),
            "num_waiting": 0,
            "kv_cache_usage": 0.5 * bool(self.running),
        }

    def step(self) -> list[EngineCoreOutput]:
        outputs, self.pending = self.pending, []
        for rid, seq in list(self.running.items()):
            outputs.append(self._next_token(seq))
            if outputs[-1].finish_reason is not None:
                del self.running[rid]
        self.steps += 1
        return outputs

    def _next_token(self, seq: _Seq) -> EngineCoreOutput:
        req, params = seq.request, seq.request.sampling_params
        k = seq.num_generated
        error = self.fail_when(req, k) if self.fail_when is not None else None
        if error is not None:
            return EngineCoreOutput(req.request_id, finish_reason="error", error=error)
        done_replying = k >= len(self.reply_ids) and not params.ignore_eos and k >= params.min_tokens
        token = self.eos_id if done_replying else self.reply_ids[k % len(self.reply_ids)]
        seq.num_generated += 1
        out = EngineCoreOutput(req.request_id, new_token_ids=[token])
        if params.logprobs is not None:
            out.new_logprobs = [self._logprobs(token, params.logprobs)]
        if not seq.started:
            seq.started = True
            prompt = tuple(req.prompt_token_ids)
            if prompt in self.seen_prompts:
                out.num_cached_tokens = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
            self.seen_prompts.add(prompt)
            if params.prompt_logprobs is not None:
                out.new_prompt_logprobs = [None] + [
                    self._logprobs(t, params.prompt_logprobs) for t in req.prompt_token_ids[1:]
                ]
            out.queue_time = 0.001
        if done_replying:
            out.finish_reason = "stop"
        elif seq.num_generated >= req.max_tokens:
            out.finish_reason = "length"
        timeline, now = seq.timeline, time.monotonic()
        if timeline is not None:
            timeline.num_steps += 1
            timeline.output_tokens += 1
            if not timeline.prefill_chunks:  # the whole prompt in this step, as the engine's first chunk
                timeline.prefill_chunks.append((now, self.steps, timeline.prompt_tokens))
                timeline.first_token = now
            if out.finish_reason is not None:
                timeline.finished = now
                out.timeline = timeline
        return out

    @staticmethod
    def _logprobs(token: int, k: int) -> TokenLogprobs:
        alternatives = [(token + 1 + i) % 256 for i in range(k)]
        return TokenLogprobs([token, *alternatives], [-0.25] + [-1.0 - i for i in range(k)], rank=1)

    def _deliver(self, message: object) -> None:
        # Through msgpack and back, as over the real socket.
        self.client._handle_message(self._decoder.decode(self._encoder.encode(message)))

    async def run(self, step_s: float) -> None:
        """Like the engine process's loop: outputs after each step with work, stats every
        STATS_INTERVAL_S while idle. A paused core says nothing at all, like a hung one."""
        last_stats = 0.0
        while True:
            await asyncio.sleep(step_s)
            if self.paused:
                continue
            if self.running or self.pending:
                self._deliver(StepOutputs(outputs=self.step(), stats=self.stats()))
                last_stats = time.monotonic()
            elif time.monotonic() - last_stats > STATS_INTERVAL_S:
                self._deliver(StepOutputs(stats=self.stats()))
                last_stats = time.monotonic()


class FakeCoreClient(CoreProcessClient):
    """The core-process client with a FakeCore where the engine process would be."""

    def __init__(self, hang_timeout_s: float, step_s: float) -> None:
        super().__init__(EngineConfig(), hang_timeout_s=hang_timeout_s)
        self.step_s = step_s
        self.core: FakeCore | None = None  # set by FakeEngine, which knows the tokenizer
        self._client_decoder = msgspec.msgpack.Decoder(ClientMessage)

    def start_loops(self) -> None:
        assert self.core is not None
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self.core.run(self.step_s)), asyncio.create_task(self._watchdog())]

    def _try_send(self, data: bytes) -> bool:
        assert self.core is not None
        self.core.receive(self._client_decoder.decode(data))
        return True


class FakeEngine(AsyncEngine):
    def __init__(
        self,
        *,
        max_model_len: int = 128,
        num_kv_blocks: int = 64,
        step_s: float = 0.001,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> None:
        client = FakeCoreClient(hang_timeout_s, step_s)
        super().__init__(EngineConfig(), client=client)
        self.step_s = step_s
        self.tokenizer = tiny_tokenizer()
        self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.info = EngineInfo(
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            block_size=BLOCK_SIZE,
            vocab_size=len(self.tokenizer),
            max_num_seqs=16,
            max_num_batched_tokens=256,
            device="fake",
            dtype="none",
        )
        reply_ids = self.tokenizer.encode(REPLY, add_special_tokens=False)
        self.core = client.core = FakeCore(client, reply_ids, self.tokenizer.eos_token_id)

    async def start(self, ready_timeout_s: float = 0.0) -> None:
        self.input_processor = InputProcessor(self.tokenizer, self.info, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client.start_loops()
