"""Builds and loads the C++ CPU kernels on first use: paged attention (csrc/cpu_paged_attention.cpp)
and matrix-vector products from GGUF-quantized weights (csrc/cpu_quant_gemv.cpp), one library.

torch's extension builder compiles them with the machine's C++ compiler into
`$TOKENMILL_CACHE/kernels/<key>` (once per source, torch version and CPU: `-march=native`), and
later processes load the built library in well under a second. `python -m
tokenmill.kernels.cpu.build` builds them ahead of time (scripts/setup.sh does).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

import torch

from tokenmill import envs
from tokenmill.cpu_cores import usable_cores
from tokenmill.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name for name in (
        "cpu_paged_attention.cpp",
        "cpu_quant_gemv.cpp",
        "cpu_quant_gemv_int8.cpp",
        "cpu_quant_gemm.cpp",
        "cpu_quant_gemm_vnni.cpp",
        "cpu_quant_gemm_int16_avx2.cpp",
        "cpu_layer_ops.cpp",
        "cpu_decode_layers.cpp",
        "cpu_helper_pool.cpp",
        "cpu_gemv16.cpp",
    )
]
# Included by the sources: part of the build's cache key (ninja tracks them inside a build directory).
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("avx2_exp.h", "helper_pool.h", "int16_panel.h", "quant_gemm_int16_avx2.h")]
_lock = threading.Lock()
_STALE_LOCK_S = 180.0  # a build takes 10-30 s; a lock older than this has no live owner
_loaded = False


class CpuKernelBuildError(RuntimeError):
    pass


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags: the build uses -march=native."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model}\n{flags}" if model or flags else platform.processor()


def build_directory() -> Path:
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*_SOURCES, *_HEADERS)),
        # The sources' paths too: ninja's build file records them, so two checkouts sharing one
        # directory would rebuild it in turn (each waiting on the other's lock) on every start.
        *(str(source.resolve()).encode() for source in _SOURCES),
        torch.__version__.encode(),
        _cpu_model().encode(),
    ):
        key.update(part)
    return cache_dir() / "kernels" / f"cpu_attention-{key.hexdigest()[:16]}"


def clear_stale_lock(directory: Path, max_age_s: float = _STALE_LOCK_S) -> bool:
    """Remove a build lock left by a process killed mid-build (torch would wait on it forever).

    A build takes well under a minute, so a lock older than `max_age_s` has no live owner.
    """
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    logger.warning("removing a stale build lock %s (%.0f s old; its build was interrupted)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def wait_for_build_lock(directory: Path, max_age_s: float = _STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """Return once `directory` holds no build lock: another process's build finished, or its lock
    grew stale and was removed. torch's own wait on the lock never ends when its owner was killed
    mid-build, so an engine started right after such a kill would hang; this bounds that wait."""
    announced = False
    while (directory / "lock").exists() and not clear_stale_lock(directory, max_age_s):
        if not announced:
            logger.info("waiting for another process's CPU kernel build (lock %s)", directory / "lock")
            announced = True
        time.sleep(poll_s)


def load_cpu_kernels() -> None:
    """Make `torch.ops.tokenmill_cpu.{paged_attention,store_kv,quant_gemv}` available (build if needed).

    Raises CpuKernelBuildError, with the compiler's message, when they cannot be built.
    """
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(directory)
        fresh = not any(directory.glob("*.so"))
        if fresh:
            logger.info("building the CPU attention kernels into %s (once; 10-30 s)", directory)
        start = time.monotonic()
        flags = ["-O3", "-march=native", "-fopenmp"]
        try:
            cpp_extension.load(
                name="tokenmill_cpu_attention",
                sources=[str(source) for source in _SOURCES],
                build_directory=str(directory),
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            raise CpuKernelBuildError(
                f"could not build the CPU attention kernels from {', '.join(map(str, _SOURCES))} in {directory}: {exc}. "
                "They need a C++ compiler (g++) and ninja; use --attention-backend torch to run without them."
            ) from exc
        if fresh:
            logger.info("CPU attention kernels built in %.0f s", time.monotonic() - start)
        _loaded = True
        _configure_helper_thread()


def _configure_helper_thread() -> None:
    """Start the CPU kernels' helper thread (csrc/helper_pool.h) where this process runs one or two
    torch threads on a machine of two or more cores: the serving engine on a small machine (one
    torch thread, leaving the other core to the API server: engine/core_process.py), where the
    helper takes that core only while it is free, and the offline engine there (two threads: the
    helper replaces the OpenMP team's static split in the products and attention, 1.06-1.31x offline
    on a 2-core Zen 3). Where more busy threads than cores share the machine the caller sleeps
    rather than spins on a chunk the helper holds, and calls under kHelperMinWork multiply-adds (tiny
    models) never wake the helper. TOKENMILL_CPU_HELPER_THREAD=0 / 1 decides instead."""
    wanted = envs.TOKENMILL_CPU_HELPER_THREAD.get()
    if wanted is None:
        wanted = torch.get_num_threads() <= 2 and usable_cores() >= 2
    torch.ops.tokenmill_cpu.set_helper_threads(1 if wanted else 0)
    if wanted:
        logger.info("CPU kernels: one helper thread shares the products and attention")


def kernels_loaded() -> bool:
    """Whether this process has loaded the kernels (never builds them: for optional fast paths)."""
    return _loaded


def cpu_kernels_available() -> tuple[bool, str]:
    """(True, "") when the kernels load, else (False, why)."""
    try:
        load_cpu_kernels()
    except CpuKernelBuildError as exc:
        return False, str(exc)
    return True, ""


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_cpu_kernels()
    print(f"CPU attention kernels ready in {build_directory()}")
