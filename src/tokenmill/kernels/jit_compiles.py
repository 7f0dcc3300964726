"""Triton JIT compiles of this process, timed through Triton's compile hooks.

Triton builds a kernel variant the first time a launch needs it: a new constexpr, dtype, or an
integer argument that turns divisible by 16 (or equal to 1). With an empty on-disk cache that takes
seconds, loading one from the cache tens to hundreds of milliseconds; inside a serving step it
stalls every request of the batch. The step trace records each one with its kernel and duration,
so a warm-up that misses a shape shows up by name.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class JitCompiles:
    """Collects (kernel name, start time, seconds) of every Triton compile until `drain()`."""

    def __init__(self) -> None:
        self._pending: dict[object, tuple[str, float]] = {}
        self._compiles: list[tuple[str, float, float]] = []
        self._installed = False
        # Warm-up and graph capture compile dozens of variants by design; only a compile after
        # `start_serving()` is a missed warm-up shape worth a warning in an operator's log.
        self._serving = False
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU build), or one older than its hooks
            logger.info("Triton compile hooks unavailable: JIT compiles are not traced")
            return
        runtime = knobs.runtime
        hooks = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        # Another JitCompiles' hooks (an engine of this process dropped without closing its trace)
        # are taken over; anyone else's are left alone.
        if any(hook is not None and not isinstance(getattr(hook, "__self__", None), JitCompiles) for hook in hooks):
            logger.warning("Triton compile hooks already set by someone else: JIT compiles are not traced")
            return
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        self._installed = True

    @property
    def installed(self) -> bool:
        return self._installed

    # Triton calls both with keyword arguments (key, repr, fn, compile, ...); a true return from the
    # first would skip the compile, so both return None.
    def _before(self, *, key: object, fn: object, **_: object) -> None:
        self._pending[_hashable(key)] = (getattr(fn, "name", str(fn)), time.monotonic())

    def _after(self, *, key: object, fn: object, compile: dict | None = None, **_: object) -> None:  # noqa: A002 - Triton's name
        name, started = self._pending.pop(_hashable(key), (getattr(fn, "name", str(fn)), time.monotonic()))
        seconds = time.monotonic() - started
        self._compiles.append((name, started, seconds))
        # The specialization (constexprs, argument types, which integers are 1 or multiples of 16,
        # which pointers are 16-byte aligned) says which warm-up shape was missing.
        detail = (compile or {}).get("specialization_data", "")
        if self._serving:
            logger.warning("Triton compiled a variant of %s while serving (%.2f s): %s", name, seconds, str(detail)[:4000])
        else:
            logger.debug("Triton compiled a variant of %s during start-up (%.2f s): %s", name, seconds, str(detail)[:4000])

    def start_serving(self) -> None:
        """From now on a compile stalls requests: each one is logged as a warning."""
        self._serving = True

    def drain(self) -> list[tuple[str, float, float]]:
        compiles, self._compiles = self._compiles, []
        return compiles

    def close(self) -> None:
        if not self._installed:
            return
        from triton import knobs

        if knobs.runtime.jit_cache_hook == self._before:
            knobs.runtime.jit_cache_hook = None
        if knobs.runtime.jit_post_compile_hook == self._after:
            knobs.runtime.jit_post_compile_hook = None
        self._installed = False


def _hashable(key: object) -> object:
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key
