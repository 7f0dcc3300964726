"""FastLauncher on CUDA: launches through the cached compiled kernel give what Triton's own
dispatch gives, and the cache never reuses a kernel across a specialization Triton makes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fast_launch import FastLauncher

pytestmark = pytest.mark.gpu


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, n, stride, scale, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src_ptr + offsets * stride, mask=mask) * scale
    if ADD_ONE:
        values += 1.0
    tl.store(dst_ptr + offsets, values, mask=mask)


def _reference(src: torch.Tensor, n: int, stride: int, scale: float, add_one: bool) -> torch.Tensor:
    values = src[: n * stride : stride] * scale
    return values + 1.0 if add_one else values


@pytest.mark.parametrize("mode", ["1", "verify"])
def test_cached_launches_match_triton(monkeypatch, mode: str) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", mode)
    launcher = FastLauncher(_scaled_copy)
    base = torch.randn(4096, device="cuda", dtype=torch.float32)
    # Aligned and unaligned pointers, strides 1 / 16 / 3, sizes that are and are not multiples of 16,
    # both values of the defaulted constexpr, each case launched twice (a miss, then a hit).
    cases = [
        (base, 1024, 1, False),
        (base[1:], 1000, 1, False),  # 4-byte offset: not 16-byte aligned
        (base, 128, 16, True),
        (base[4:], 77, 3, False),
        (base, 1, 1, True),
    ]
    for src, n, stride, add_one in cases:
        for _ in range(2):
            dst = torch.empty(n, device="cuda", dtype=torch.float32)
            kwargs = {"BLOCK": 256}
            if add_one:
                kwargs["ADD_ONE"] = True
            launcher((triton.cdiv(n, 256),), src, dst, n, stride, 0.5, **kwargs)
            torch.testing.assert_close(dst, _reference(src, n, stride, 0.5, add_one), rtol=0, atol=0)
    assert launcher.hits == (len(cases) if mode == "1" else 0)
    # Keys finer than Triton's: each case got a compiled kernel of its own or a shared one, but a
    # key never maps to a kernel compiled for another specialization (verify mode raises if so).
    assert len(launcher.compiled) == len(cases)


def test_off_takes_tritons_path(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "0")
    launcher = FastLauncher(_scaled_copy)
    src = torch.randn(512, device="cuda")
    dst = torch.empty(512, device="cuda")
    for _ in range(3):
        launcher((2,), src, dst, 512, 1, 2.0, BLOCK=256)
    torch.testing.assert_close(dst, src * 2.0, rtol=0, atol=0)
    assert launcher.hits == 0 and not launcher.compiled


def test_cpu_tensors_fall_back(monkeypatch) -> None:
    """A launch with a CPU tensor is left to Triton (which rejects it), never cached."""
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "1")
    launcher = FastLauncher(_scaled_copy)
    with pytest.raises(Exception):  # noqa: B017 - Triton's own error for a host pointer
        launcher((1,), torch.zeros(16), torch.zeros(16, device="cuda"), 16, 1, 1.0, BLOCK=16)
    assert not launcher.compiled
