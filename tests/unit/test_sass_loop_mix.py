"""benchmarks/sass_loop_mix.py compiles a launcher's real kernel launch for sm_90 without a GPU.

The tool's counts steer kernel work between device calls, so it must keep compiling what the
launchers launch (with their runtime specialization) and keep finding the main loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tokenmill

ROOT = Path(tokenmill.__file__).parents[2]
triton = pytest.importorskip("triton")
NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


@pytest.mark.skipif(not NVDISASM.is_file(), reason="this triton wheel bundles no nvdisasm")
def test_the_fp8_gemv_launch_compiles_for_sm90_with_its_x_loads_specialized() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sass_loop_mix.py"), "--kernels", "fp8", "--shapes", "o_proj"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    header, mix = [line for line in result.stdout.splitlines() if line.strip()][:2]
    assert header.startswith("fp8 gemv o_proj") and "a weight" in header
    loop_instructions = int(header.split("loop ")[1].split()[0])
    # The one-row GEMV's loop: converts e4m3 pairs (F2FP) and multiplies in float32 (FFMA).
    assert 16 <= loop_instructions <= 1000 and "F2FP" in mix and "FFMA" in mix
