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

from collections.abc import Sequence

import torch
import triton

from tokenmill import envs

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_LIMIT = 2**63


def fast_launch_mode() -> str:
    """The TOKENMILL_TRITON_FAST_LAUNCH setting: "1" (default), "0" (off) or "verify"."""
    return envs.TOKENMILL_TRITON_FAST_LAUNCH.get()


def _hook_set(hook: object) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 keeps an always-present `HookChain`
    (empty unless a profiler added a call), later versions None when unset."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _profiler_listening() -> bool:
    """Whether a profiler set Triton's launch hooks: it wants each launch's metadata, so launches
    take Triton's own path meanwhile."""
    knobs = triton.knobs.runtime
    return _hook_set(knobs.launch_enter_hook) or _hook_set(knobs.launch_exit_hook)


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


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
        self._launch(grid, args, kwargs)

    def prepare(
        self, swappable: Sequence[torch.Tensor], grid: Sequence[int], *args, **kwargs
    ) -> PreparedLaunch | None:
        """Launch as `__call__` does and return the launch for replaying with the `swappable`
        tensors (found among the arguments by identity) replaced by others of the same dtype,
        shape, strides and alignment; None where it took Triton's own path (nothing to replay)."""
        compiled = self._launch(grid, args, kwargs)
        if compiled is None:
            return None
        values = self._values(args, kwargs)
        positions = tuple(
            tuple(i for i, value in enumerate(values) if value is tensor) for tensor in swappable
        )
        for tensor_positions in positions:  # the replay fills these in; don't keep this launch's tensors
            for i in tensor_positions:
                values[i] = None
        facts = tuple(map(_facts, swappable))
        return PreparedLaunch(self, compiled, _grid3(grid), kwargs, values, positions, facts, _aliases(swappable))

    def _launch(self, grid: Sequence[int], args: tuple, kwargs: dict) -> object | None:
        """Launch; the compiled kernel when this launch's key is cached (or now is), else None."""
        mode = fast_launch_mode()
        key = self._key(args, kwargs) if mode != "0" else None
        if key is None:
            self.kernel[grid](*args, **kwargs)
            return None
        compiled = self.compiled.get(key)
        if compiled is None or self.verify or mode == "verify":
            chosen = self.kernel[grid](*args, **kwargs)
            self._check_choice(compiled, chosen)
            self.compiled[key] = chosen
            return chosen
        self.hits += 1
        self._run(compiled, _grid3(grid), self._values(args, kwargs))
        return compiled

    def _check_choice(self, cached: object | None, chosen: object) -> None:
        if cached is not None and chosen is not cached:
            raise AssertionError(
                f"FastLauncher({self.kernel.__name__}): the cached kernel for this key is not the one "
                "Triton's dispatch chose; the key misses part of Triton's specialization"
            )

    def _values(self, args: tuple, kwargs: dict) -> list:
        """Every parameter's value in signature order, as JITFunction.run passes them to the launcher."""
        values = list(args)
        for name in self.constexpr_names:
            values.append(kwargs[name] if name in kwargs else self.constexpr_defaults[name])
        return values

    def _run(self, compiled, grid: tuple[int, int, int], values: list) -> None:  # noqa: ANN001
        driver = self._driver
        stream = driver.get_current_stream(driver.get_current_device())
        # The launcher's arguments after the kernel's function: its packed metadata, the launch
        # metadata and the enter / exit hooks (none: _key and bind checked that no profiler listens).
        compiled.run(
            *grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values
        )  # fmt: skip

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        """This launch's key, or None where it must take Triton's own path."""
        if self.constexpr_names is None or len(args) != self.num_runtime:
            return None
        if _profiler_listening():
            return None
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


def _aliases(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor, the index of the first one that is the same object."""
    return tuple(next(j for j, other in enumerate(tensors) if other is tensor) for tensor in tensors)


def _facts(tensor: torch.Tensor) -> tuple:
    """What a replacement tensor must share with the one a launch was prepared with."""
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.data_ptr() & 15 == 0)


class PreparedLaunch:
    """One launch of a FastLauncher, replayable with its swappable tensors replaced (the other
    arguments, the grid and the compiled kernel stay): a mixed step launches the same attention for
    every layer with only the layer's KV cache, q and output changing."""

    __slots__ = ("launcher", "compiled", "grid", "kwargs", "values", "positions", "facts", "aliases")

    def __init__(
        self, launcher: FastLauncher, compiled, grid, kwargs, values, positions, facts, aliases
    ) -> None:  # noqa: ANN001
        self.launcher = launcher
        self.compiled = compiled
        self.grid = grid
        self.kwargs = kwargs
        self.values = values
        self.positions = positions
        self.facts = facts
        # Which swappable tensors were one object (they share argument positions): a replay must
        # alias the same ones, or one tensor would land in the other's place.
        self.aliases = aliases

    def bind(self, tensors: Sequence[torch.Tensor]) -> list | None:
        """The launch's argument values with `tensors` in place of the swappable ones, or None when
        one differs from its original in dtype, shape, strides, alignment (or the launcher is off, or
        a profiler listens: then the caller launches afresh, through Triton)."""
        if fast_launch_mode() == "0" or _aliases(tensors) != self.aliases or _profiler_listening():
            return None
        values = self.values.copy()
        for tensor, positions, facts in zip(tensors, self.positions, self.facts, strict=True):
            if not tensor.is_cuda or _facts(tensor) != facts:
                return None
            for i in positions:
                values[i] = tensor
        return values

    def launch(self, values: list) -> None:
        """Launch with values from `bind`."""
        launcher = self.launcher
        if launcher.verify or fast_launch_mode() == "verify":
            chosen = launcher.kernel[self.grid](*values[: launcher.num_runtime], **self.kwargs)
            launcher._check_choice(self.compiled, chosen)
            return
        launcher.hits += 1
        launcher._run(self.compiled, self.grid, values)
