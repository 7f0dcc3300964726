"""The offline API, with vLLM's names so users can switch: `LLM(...).generate(...)` / `.chat(...)`."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.args import EngineArgs
from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import InprocClient
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.fanout import fan_out
from tokenmill.engine.gc_frozen import objects_frozen_while_generating
from tokenmill.engine.input_processor import InputProcessor, PromptInput
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidRequestError, LLMClosedError
from tokenmill.lora.request import LoRARequest
from tokenmill.model.tokenizer import load_tokenizer_or_none  # noqa: F401  (re-exported: older import path)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def import_off_stack(module: str) -> None:
    """Imports `module` on a short-lived thread unless it is loaded already.

    Importing torch runs `torch.fx.wrap` at module level, whose frame refers to itself (a local
    holding `inspect.currentframe()`): that cycle keeps every frame on the importing stack, and
    their locals, until a full garbage collection. Imported from `LLM.__init__` itself, the first
    `LLM` of a process (its `self`), and any caller's locals such as a function that returns it,
    would outlive `del llm`; a thread's stack holds none of them."""
    if module in sys.modules:
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            importlib.import_module(module)
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"import-{module}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """The EngineConfig of `LLM(model, **kwargs)`; the options are EngineArgs' fields."""
    return EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()


class LLM:
    """An engine in this process. `model=None` loads the default model (SmolLM2-135M-Instruct).

    The frontend pieces are those of the API server's AsyncEngine (fan_out for n > 1, the input and
    output processors); the engine core is reached through an InprocClient and stepped here.
    `engine` is the EngineCore itself, for benchmarks and tests that look inside it.

    `close()` (or leaving a `with LLM(...) as llm:` block) frees the KV pool and the weights and
    ends tensor-parallel workers at once; any later call raises LLMClosedError. Without it, the
    engine is freed when the last reference to the LLM goes (no garbage collection needed)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        import_off_stack("torch")
        import torch

        from tokenmill.model.generation_defaults import generation_defaults
        from tokenmill.model.resolve import resolve_model
        from tokenmill.model.tokenizer import eos_token_ids

        if kwargs.get("otlp_traces_endpoint") is not None:  # refused, not ignored: spans are the server's
            raise ValueError(
                "otlp_traces_endpoint: the offline LLM exports no spans (only `tokenmill serve "
                "--otlp-traces-endpoint` does); leave it out"
            )
        # Offline no stream waits on its next token, so the CPU's prefill cap while decoding (a
        # latency bound for serving) only costs throughput here: 0.88-0.97x of uncapped in the
        # 64 x 128/128 benchmark (docs/CPU_PERFORMANCE.md). Off unless asked for.
        if kwargs.get("max_prefill_tokens_while_decoding") is None:  # None: the default (bench passes it)
            kwargs["max_prefill_tokens_while_decoding"] = 0
        if kwargs.get("prefill_step_target_ms") is None:  # the same: a latency bound, off offline
            kwargs["prefill_step_target_ms"] = 0.0
        self.config = build_engine_config(model, **kwargs)
        torch.manual_seed(self.config.model.seed)
        self.resolved = resolve_model(self.config.model)
        # The model's sampling defaults (--generation-config), for calls that pass no SamplingParams.
        self.default_sampling_fields = generation_defaults(self.config.model, self.resolved)
        self.tokenizer = load_tokenizer_or_none(self.resolved, self.config.model.chat_template)
        self._engine: EngineCore | None = EngineCore(self.config, self.resolved)
        self._client: InprocClient | None = InprocClient(self._engine)
        self.info = self._engine.info
        eos = (
            eos_token_ids(self.tokenizer, self.resolved)
            if self.tokenizer is not None
            else self.resolved.arch.eos_token_ids
        )
        self.input_processor = InputProcessor(self.tokenizer, self.info, eos)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._loras: dict[int, LoRARequest] = {}  # adapters checked and handed to the engine, by id

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            raise LLMClosedError("this LLM is closed (close() was called): make a new LLM to generate again")
        return self._engine

    @property
    def client(self) -> InprocClient:
        if self._client is None:
            raise LLMClosedError("this LLM is closed (close() was called): make a new LLM to generate again")
        return self._client

    @property
    def closed(self) -> bool:
        return self._engine is None

    def close(self) -> None:
        """Free the KV pool, the weights and the devices' memory, and end the engine's workers
        (tensor parallelism's processes); idempotent. Every later call raises LLMClosedError."""
        engine, client = self._engine, self._client
        if engine is None or client is None:
            return
        # Forgotten first: even if the shutdown raises, this LLM no longer holds the engine (its
        # block pool, scheduler and runner go with the last reference), and it stays closed.
        self._engine = self._client = None
        client.shutdown()

    def shutdown(self) -> None:
        """The same as close() (the name the engine's other clients use)."""
        self.close()

    def __enter__(self) -> LLM:
        self.engine  # noqa: B018 - raises LLMClosedError: a closed LLM cannot be entered again
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: tokenmill's defaults with
        the model's generation config on top (see `--generation-config`), as vLLM's LLM does."""
        return SamplingParams(**self.default_sampling_fields)

    # -- generate -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one (or None: the base model) per
        prompt; LoRA must be enabled (`enable_lora=True`)."""
        self.client  # noqa: B018 - a closed LLM raises LLMClosedError before anything is staged
        prompt_list = self._as_prompt_list(prompts)
        lora_list = self._lora_requests(lora_request, len(prompt_list))
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; pass one, or one per prompt",
                    param="sampling_params",
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidRequestError(
                f"got {len(priority)} priorities for {len(prompt_list)} prompts", param="priority"
            )

        # Validate everything before adding anything: a bad prompt leaves the engine untouched.
        staged = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            text, token_ids = self.input_processor.tokenize(prompt)
            request_id = str(next(self._ids))
            children = []
            for child in fan_out(request_id, params):
                core_req = self.input_processor.make_request(
                    child.request_id,
                    token_ids,
                    child.params,
                    priority=priority[i] if priority else 0,
                    cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
                    lora_request=lora_list[i],
                )
                children.append((child.request_id, child.index, core_req))
            staged.append((request_id, text, token_ids, params, children))

        order = []
        for request_id, text, token_ids, _params, children in staged:
            order.append(request_id)
            for child_id, index, core_req in children:
                self.output_processor.add_request(
                    child_id, request_id, index, text, token_ids, core_req.sampling_params
                )
                self.client.add_requests([core_req])
        # The model and the engine's objects stay out of the collector's walks while this runs.
        with objects_frozen_while_generating():
            return self._run_to_completion(order, {rid: p.n for rid, _, _, p, _ in staged}, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run_to_completion(
        self, order: list[str], num_children: dict[str, int], use_tqdm: bool
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        done_children: dict[str, int] = {}
        progress = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        try:
            while self.output_processor.has_unfinished():
                core_outputs = self.client.get_output()
                processed = self.output_processor.process_outputs(core_outputs)
                if processed.reqs_to_abort:
                    self.client.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if not out.finished:
                        continue
                    merged = results.get(out.request_id)
                    if merged is None:
                        results[out.request_id] = out
                    else:
                        merged.outputs.extend(out.outputs)
                        merged.num_cached_tokens = min(merged.num_cached_tokens, out.num_cached_tokens)
                        merged.error = merged.error or out.error
                    done_children[out.request_id] = done_children.get(out.request_id, 0) + 1
                    if done_children[out.request_id] == num_children[out.request_id]:
                        progress.update(1)
            # Drain aborts of stop-string matches so their blocks are freed before we return.
            while self.client.has_work():
                self.client.get_output()
        except BaseException:
            # Leave the engine clean for the next call (e.g. KeyboardInterrupt mid-generation).
            pending = list(self.output_processor.states)
            for rid in pending:
                self.output_processor.abort_request(rid)
            self.client.abort_requests(pending)
            while self.client.has_work():
                self.client.get_output()
            raise
        finally:
            progress.close()
        outputs = []
        for rid in order:
            result = results[rid]
            result.outputs.sort(key=lambda c: c.index)
            result.finished = True
            outputs.append(result)
        return outputs

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        from tokenmill.chat_template import render_chat

        return render_chat(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )

    def _lora_requests(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; each adapter seen for the first time is checked against
        the model (a bad one raises InvalidRequestError naming the problem) and starts loading."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise InvalidRequestError(
                    f"got {len(loras)} LoRA requests for {num_prompts} prompts; pass one, or one per prompt",
                    param="lora_request",
                )
        lora_config = self.engine.config.lora
        for lora in {lora for lora in loras if lora is not None}:
            if lora_config is None:
                raise InvalidRequestError(
                    "lora_request needs LoRA enabled: LLM(..., enable_lora=True)", param="lora_request"
                )
            if self._loras.get(lora.lora_int_id) == lora:
                continue
            from tokenmill.lora.adapter_files import AdapterError, read_adapter

            try:
                read_adapter(lora.lora_path, self.engine.resolved.arch, lora_config.max_lora_rank)
            except AdapterError as exc:
                raise InvalidRequestError(str(exc), param="lora_request") from None
            known = self._loras.get(lora.lora_int_id)
            if known is not None:
                raise InvalidRequestError(
                    f"lora_int_id {lora.lora_int_id} is already {known.lora_name!r} at {known.lora_path}; "
                    "give each adapter its own id",
                    param="lora_request",
                )
            self.engine.add_lora(lora)
            self._loras[lora.lora_int_id] = lora
        return loras

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        self.client  # noqa: B018 - a closed LLM raises LLMClosedError before any template renders
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.apply_chat_template(
                    conversation,  # type: ignore[arg-type]
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def stream_generate(llm: LLM, prompt: PromptInput, params: SamplingParams):
    """Yields text deltas of one prompt as they are produced (used by `tokenmill generate`)."""
    client = llm.client  # a closed LLM raises LLMClosedError here
    text, token_ids = llm.input_processor.tokenize(prompt)
    request_id = f"stream-{next(llm._ids)}"
    core_req = llm.input_processor.make_request(request_id, token_ids, dataclasses.replace(params, n=1))
    llm.output_processor.add_request(
        request_id, request_id, 0, text, token_ids, core_req.sampling_params, stream=True
    )
    client.add_requests([core_req])
    try:
        while llm.output_processor.has_unfinished():
            processed = llm.output_processor.process_outputs(client.get_output())
            if processed.reqs_to_abort:
                client.abort_requests(processed.reqs_to_abort)
            for out in processed.request_outputs:
                if out.outputs[0].text:
                    yield out.outputs[0].text
    finally:
        if llm.output_processor.states.pop(request_id, None) is not None:
            client.abort_requests([request_id])
        while client.has_work():
            client.get_output()
