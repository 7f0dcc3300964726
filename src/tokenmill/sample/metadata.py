"""Per-step sampling parameters of a batch, as device tensors built once from Python lists.

The model runner describes each row (one request that samples a token this step) with a
`RowSamplingInfo`; `SamplingMetadata.build` turns the rows into a handful of tensors (one
`torch.tensor` call each, through pinned memory and a non-blocking copy on CUDA) plus host-side
flags, so the sampler never syncs with the device and the common all-greedy batch costs one argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.sample.logits_processors import AllowedTokens, LogitBias, bad_word_bans
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class RowSamplingInfo:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-request RNG (from `make_generator(params.seed, device)`), kept by the runner across steps
    # so a seeded request draws the same noise whatever else is in the batch.
    generator: torch.Generator | None = None
    # Banned (logit -inf) together with params.stop_token_ids while the request has fewer than
    # params.min_tokens output tokens. Ignored when params.ignore_eos.
    eos_token_ids: Sequence[int] = ()


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor from a Python list; on CUDA through pinned memory with an async copy."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _numpy_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass(slots=True)
class TokenSets:
    """Token ids of each row, flattened: row `row_indices[i]` holds token `token_ids[i]`."""

    row_indices: torch.Tensor  # [T] int64
    token_ids: torch.Tensor  # [T] int64

    @staticmethod
    def build(per_row: list[Sequence[int]], vocab_size: int, device: torch.device) -> TokenSets:
        lengths = [len(ids) for ids in per_row]
        total = sum(lengths)
        # np.fromiter is ~4x faster than torch.tensor on a long list of Python ints.
        token_ids = np.fromiter(itertools.chain.from_iterable(per_row), dtype=np.int64, count=total)
        row_indices = np.repeat(np.arange(len(per_row), dtype=np.int64), lengths)
        in_vocab = (token_ids >= 0) & (token_ids < vocab_size)
        if not in_vocab.all():  # an out-of-range id would be a device-side assert in index_put_
            token_ids, row_indices = token_ids[in_vocab], row_indices[in_vocab]
        return TokenSets(_numpy_to_device(row_indices, device), _numpy_to_device(token_ids, device))

    def counts(self, num_rows: int, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_rows, vocab_size] occurrence counts."""
        out = torch.zeros(num_rows, vocab_size, dtype=dtype, device=self.token_ids.device)
        ones = torch.ones(self.token_ids.shape[0], dtype=dtype, device=out.device)
        return out.index_put_((self.row_indices, self.token_ids), ones, accumulate=True)


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    device: torch.device

    all_greedy: bool
    all_random: bool
    # [N] float32 with 1.0 on greedy rows (they take the argmax before temperature); None if all greedy.
    temperature: torch.Tensor | None
    greedy_mask: torch.Tensor | None  # [N] bool; only for a mix of greedy and random rows

    # Filters; None when no row uses them. top_k is [N] int64 with disabled rows set to vocab_size.
    top_k: torch.Tensor | None
    max_top_k: int  # largest enabled top_k (host int, sizes torch.topk)
    top_k_on_all_random_rows: bool  # every non-greedy row has a top_k: top_p needs no full sort
    top_p: torch.Tensor | None  # [N] float32, 1.0 = off
    min_p: torch.Tensor | None  # [N] float32, 0.0 = off

    # Penalties; no_penalties means all three are None.
    no_penalties: bool
    presence_penalty: torch.Tensor | None  # [N, 1] float32
    frequency_penalty: torch.Tensor | None  # [N, 1] float32
    repetition_penalty: torch.Tensor | None  # [N, 1] float32
    output_tokens: TokenSets | None  # output tokens of rows with any penalty
    prompt_tokens: TokenSets | None  # prompt tokens of rows with a repetition penalty

    # (row, token) pairs forced to -inf: stop tokens of rows still under min_tokens, and the
    # tokens that would complete a bad word.
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None

    # Logits processors (None when no row uses them): logit_bias and allowed_token_ids.
    logit_bias: LogitBias | None
    allowed_tokens: AllowedTokens | None

    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its own RNG
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, params.logprobs
    max_num_logprobs: int | None = None  # None: no row wants logprobs

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @staticmethod
    def build(
        rows: Sequence[RowSamplingInfo], device: torch.device | str, vocab_size: int
    ) -> SamplingMetadata:
        device = torch.device(device)
        n = len(rows)
        temperature: list[float] = []
        greedy: list[bool] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        output_sets: list[Sequence[int]] = []
        prompt_sets: list[Sequence[int]] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        restricted: list[bool] = []
        allowed_rows: list[int] = []
        allowed_ids: list[int] = []
        generators: dict[int, torch.Generator] = {}
        num_logprobs: list[int | None] = []
        any_penalty = False
        top_k_on_all_random_rows = True

        for i, row in enumerate(rows):
            p = row.params
            is_greedy = p.is_greedy
            greedy.append(is_greedy)
            temperature.append(1.0 if is_greedy else p.temperature)
            top_k.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
            if not is_greedy and top_k[-1] == vocab_size:
                top_k_on_all_random_rows = False
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            has_penalties = p.has_penalties
            any_penalty = any_penalty or has_penalties
            output_sets.append(row.output_token_ids if has_penalties else ())
            # Only the repetition penalty reads the prompt too.
            prompt_sets.append(row.prompt_token_ids if p.repetition_penalty != 1.0 else ())
            banned: set[int] = set()
            if len(row.output_token_ids) < p.min_tokens:
                banned.update(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(row.eos_token_ids)
            if p.bad_words_token_ids:
                banned |= bad_word_bans(p.bad_words_token_ids, row.output_token_ids)
            # Out-of-vocab ids are dropped: they would be a device-side assert in index_put_.
            banned = {t for t in banned if 0 <= t < vocab_size}
            banned_rows.extend([i] * len(banned))
            banned_ids.extend(sorted(banned))
            if p.logit_bias:
                for token_id, value in p.logit_bias.items():
                    if 0 <= token_id < vocab_size:
                        bias_rows.append(i)
                        bias_ids.append(token_id)
                        bias_values.append(float(value))
            restricted.append(p.allowed_token_ids is not None)
            if p.allowed_token_ids is not None:
                allowed = {t for t in p.allowed_token_ids if 0 <= t < vocab_size}
                allowed_rows.extend([i] * len(allowed))
                allowed_ids.extend(sorted(allowed))
            if row.generator is not None and not is_greedy:
                generators[i] = row.generator
            num_logprobs.append(p.logprobs)

        all_greedy = all(greedy)
        all_random = not any(greedy)
        no_penalties = not any_penalty
        enabled_top_k = [k for k in top_k if k < vocab_size]
        use_top_k = not all_greedy and bool(enabled_top_k)
        use_top_p = not all_greedy and any(x < 1.0 for x in top_p)
        use_min_p = not all_greedy and any(x > 0.0 for x in min_p)
        requested = [k for k in num_logprobs if k is not None]

        def col(values: list[float]) -> torch.Tensor:
            return host_to_device(values, torch.float32, device).unsqueeze(1)

        def ids(values: list[int]) -> torch.Tensor:
            return host_to_device(values, torch.int64, device)

        logit_bias = None
        if bias_rows:
            logit_bias = LogitBias(ids(bias_rows), ids(bias_ids), host_to_device(bias_values, torch.float32, device))
        allowed_tokens = None
        if any(restricted):
            allowed_tokens = AllowedTokens(host_to_device(restricted, torch.bool, device), ids(allowed_rows), ids(allowed_ids))

        return SamplingMetadata(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None if all_greedy else host_to_device(temperature, torch.float32, device),
            greedy_mask=None if all_greedy or all_random else host_to_device(greedy, torch.bool, device),
            top_k=host_to_device(top_k, torch.int64, device) if use_top_k else None,
            max_top_k=max(enabled_top_k, default=0),
            top_k_on_all_random_rows=use_top_k and top_k_on_all_random_rows,
            top_p=host_to_device(top_p, torch.float32, device) if use_top_p else None,
            min_p=host_to_device(min_p, torch.float32, device) if use_min_p else None,
            no_penalties=no_penalties,
            presence_penalty=None if no_penalties else col(presence),
            frequency_penalty=None if no_penalties else col(frequency),
            repetition_penalty=None if no_penalties else col(repetition),
            output_tokens=None if no_penalties else TokenSets.build(output_sets, vocab_size, device),
            prompt_tokens=TokenSets.build(prompt_sets, vocab_size, device) if any(prompt_sets) else None,
            banned_rows=host_to_device(banned_rows, torch.int64, device) if banned_rows else None,
            banned_token_ids=host_to_device(banned_ids, torch.int64, device) if banned_rows else None,
            logit_bias=logit_bias,
            allowed_tokens=allowed_tokens,
            generators=generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
        )
