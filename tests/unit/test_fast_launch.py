"""FastLauncher's host-side logic on the CPU (its launches are tested on CUDA in
tests/gpu/test_fast_launch_gpu.py; interpreted launches take Triton's own path, which the
interpreted attention tests exercise)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tokenmill import envs  # noqa: E402
from tokenmill.kernels.triton.fast_launch import FastLauncher, _aliases  # noqa: E402


@triton.jit
def _doubled(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


@triton.jit
def _constexpr_first(src_ptr, BLOCK: tl.constexpr, n):
    tl.store(src_ptr + tl.arange(0, BLOCK), 0.0)


def test_signature_layout() -> None:
    launcher = FastLauncher(_doubled)
    if launcher.constexpr_names is None and type(_doubled).__name__ != "JITFunction":
        pytest.skip("triton runs interpreted in this process: kernels have no parameter list")
    assert launcher.constexpr_names == ("BLOCK",) and launcher.num_runtime == 3
    # A constexpr before a runtime parameter: the direct launch's argument order would be wrong,
    # so every launch takes Triton's own path.
    assert FastLauncher(_constexpr_first).constexpr_names is None


def test_host_tensors_take_tritons_path_without_a_key() -> None:
    launcher = FastLauncher(_doubled)
    assert launcher._key((torch.zeros(4), torch.zeros(4), 4), {"BLOCK": 4}) is None
    assert launcher._key((torch.zeros(4), torch.zeros(4)), {"BLOCK": 4}) is None  # too few arguments
    assert not launcher.compiled and launcher.hits == 0


def test_aliases_name_the_first_identical_tensor() -> None:
    a, b = torch.zeros(2), torch.zeros(2)
    assert _aliases((a, b, a, b)) == (0, 1, 0, 1)
    assert _aliases((a, b, torch.zeros(2))) == (0, 1, 2)


@pytest.mark.parametrize(
    ("raw", "mode"), [("", "1"), ("on", "1"), ("0", "0"), ("false", "0"), ("Verify", "verify")]
)
def test_mode_setting(monkeypatch, raw: str, mode: str) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", raw)
    assert envs.TOKENMILL_TRITON_FAST_LAUNCH.get() == mode


def test_bad_mode_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRITON_FAST_LAUNCH", "fast")
    with pytest.raises(ValueError, match="TOKENMILL_TRITON_FAST_LAUNCH='fast'.*1, 0 or verify"):
        envs.TOKENMILL_TRITON_FAST_LAUNCH.get()
