"""Launching a Triton kernel again without Triton's per-call dispatch.

`kernel[grid](*args, **constexprs)` binds every argument, computes Triton's specialization of each
(dtypes, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), builds the cache
key from them and the options, looks the compiled kernel up and only then launches it. For a kernel
with ~90 parameters, like the paged attention's, that is tens of microseconds of host time per
launch; a mixed prefill + decode step launches attention eagerly between its CUDA-graph pieces two
to three times per layer, so on small and medium batches the host, not the GPU, sets the step time.

`FastLauncher` keeps, per kernel, a map from a key of its own to the compiled kernel Triton's own
dispatch returned the first time. The key is at least as fine as Triton's: every constexpr and
option by name and value, and for each runtime argument its Python type and, for tensors, the dtype
and whether the pointer is 16-byte aligned; for integers whether they are 1, divisible by 16 and
fit in 32 bits. Equal keys therefore mean equal Triton specializations, and a hit launches
`CompiledKernel.run` directly with the same arguments `JITFunction.run` would pass. Anything it does
not recognise (another argument type, launch hooks set by a profiler, the CPU interpreter) takes
Triton's own path, every time.

`TOKENMILL_TRITON_FAST_LAUNCH=0` turns it off (A/B runs; a Triton upgrade that changes the launch
convention). `=verify` (or `verify=True`, tests) asks Triton's dispatch for every launch as well,
launching through it, and raises if it chose another compiled kernel than the cached one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_LIMIT = 2**63


def fast_launch_mode() -> str:
    """The TOKENMILL_TRITON_FAST_LAUNCH setting: 1 (default), 0 (off) or verify."""
    return os.environ.get("TOKENMILL_TRITON_FAST_LAUNCH", "1")


def _hook_set(hook: object) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 keeps an always-present `HookChain`
    (empty unless a profiler added a call), later versions None when unset."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


class FastLauncher:
    """Launches one `@triton.jit` kernel, reusing the compiled kernel Triton picked for a key."""

    __slots__ = (
        "kernel", "constexpr_names", "constexpr_defaults", "num_runtime", "compiled", "verify", "hits", "_driver"
    )  # fmt: skip

    def __init__(self, kernel, *, verify: bool = False) -> None:
        self.kernel = kernel
        self.verify = verify
        self.compiled: dict[tuple, object] = {}
        self.hits = 0
        self._driver = None
        params = getattr(kernel, "params", None)
        names: list[str] = []
        defaults: dict[str, object] = {}
        runtime = 0
        # The direct launch passes the runtime arguments, then the constexprs, in signature order:
        # that only works when every runtime parameter comes before every constexpr one.
        layout_ok = params is not None
        for param in params or ():
            if param.is_constexpr:
                names.append(param.name)
                if param.has_default:
                    defaults[param.name] = param.default
            elif names:
                layout_ok = False
            else:
                runtime += 1
        self.constexpr_names: tuple[str, ...] | None = tuple(names) if layout_ok else None
        self.constexpr_defaults = defaults
        self.num_runtime = runtime

    def __call__(self, grid: Sequence[int], *args, **kwargs) -> None:
        """Same as `kernel[grid](*args, **kwargs)` (runtime arguments positional, constexprs and
        options such as num_warps by name)."""
        mode = fast_launch_mode()
        key = self._key(args, kwargs) if mode != "0" else None
        if key is None:
            self.kernel[grid](*args, **kwargs)
            return
        compiled = self.compiled.get(key)
        if compiled is None or self.verify or mode == "verify":
            chosen = self.kernel[grid](*args, **kwargs)
            if compiled is not None and chosen is not compiled:
                raise AssertionError(
                    f"FastLauncher({self.kernel.__name__}): the cached kernel for this key is not the one "
                    "Triton's dispatch chose; the key misses part of Triton's specialization"
                )
            self.compiled[key] = chosen
            return
        self.hits += 1
        values = list(args)
        for name in self.constexpr_names:
            values.append(kwargs[name] if name in kwargs else self.constexpr_defaults[name])
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        driver = self._driver
        stream = driver.get_current_stream(driver.get_current_device())
        compiled.run(
            grid_0,
            grid_1,
            grid_2,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *values,
        )

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        """This launch's key, or None where it must take Triton's own path."""
        if self.constexpr_names is None or len(args) != self.num_runtime:
            return None
        knobs = triton.knobs.runtime
        if _hook_set(knobs.launch_enter_hook) or _hook_set(knobs.launch_exit_hook):
            return None  # a profiler wants launch metadata: let Triton build it
        specs: list[object] = []
        append = specs.append
        for arg in args:
            kind = type(arg)
            if kind is torch.Tensor or isinstance(arg, torch.Tensor):
                if not arg.is_cuda:
                    return None
                append((arg.dtype, arg.data_ptr() & 15 == 0))
            elif kind is bool:
                append((bool, arg))
            elif kind is int:
                # Triton types an integer i32, i64 or u64 by its range and specializes on == 1 and % 16.
                append((int, arg == 1, arg & 15 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg < _INT64_LIMIT))
            elif kind is float:
                append(float)
            elif arg is None:
                append(None)
            else:
                return None
        driver = self._driver
        if driver is None:
            driver = self._driver = triton.runtime.driver.active
        append(driver.get_current_device())
        append(tuple(kwargs.items()))
        return tuple(specs)
