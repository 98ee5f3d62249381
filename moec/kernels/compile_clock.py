"""Seconds spent compiling and autotuning moec's kernels, per backend, outside Inductor.

- ``triton``: Triton's compilation listener (every kernel compiled, with its compile time, or
  loaded from the cache) and its autotuning listener (every key benchmarked, with the time, or
  answered from the disk cache). Kernels Triton compiles while Dynamo/Inductor compile a graph
  are Inductor's own and counted with Inductor, not here.
- ``cute``: the CuTe DSL's ``cute.compile`` calls (quack's GEMMs, FlashAttention 4) and quack's
  autotuner (its benchmarking and its parallel pre-compile), hooked where those packages are
  installed and the device is a GPU.

A kernel compiled while an autotuner benchmarks counts as JIT; the rest of the autotuning window
as autotuning, so the two never overlap. :class:`KernelClock` counts while it is
:meth:`~KernelClock.started` and until :meth:`~KernelClock.stop`; the hooks are installed once
per process and feed every running clock.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time
import weakref
from typing import Any

BACKENDS = ("triton", "cute")

_CLOCKS: weakref.WeakSet[KernelClock] = weakref.WeakSet()
_INSTALLED: set[str] = set()


@dataclasses.dataclass
class BackendTimes:
    """One backend's compile and autotuning work."""

    jit_s: float = 0.0
    autotune_s: float = 0.0
    kernels_compiled: int = 0
    kernels_cached: int = 0
    """Kernels loaded from a compile cache (Triton's; quack's cache loads are not seen)."""
    configs_benchmarked: int = 0
    autotune_cached: int = 0
    """Autotuned keys answered from the disk cache (Triton's)."""


class KernelClock:
    """Kernel compile and autotuning time per backend (see module)."""

    def __init__(self) -> None:
        self.times = {backend: BackendTimes() for backend in BACKENDS}
        self._jit_ends: dict[str, list[tuple[float, float]]] = {b: [] for b in BACKENDS}

    def start(self, cute: bool) -> KernelClock:
        """Count from now; ``cute``: hook the CuTe DSL too (a GPU run where it is installed;
        importing it takes seconds, so a CPU run does not)."""
        _install_triton()
        if cute:
            _install_cute()
        _CLOCKS.add(self)
        return self

    def stop(self) -> dict[str, dict[str, Any]]:
        """Stop counting; the times by backend."""
        _CLOCKS.discard(self)
        return {backend: dataclasses.asdict(t) for backend, t in self.times.items()}

    def jit(self, backend: str, seconds: float, cached: bool) -> None:
        """A kernel compiled in ``seconds`` (or loaded from the cache: ``cached``)."""
        times = self.times[backend]
        if cached:
            times.kernels_cached += 1
            return
        times.kernels_compiled += 1
        times.jit_s += seconds
        self._jit_ends[backend].append((time.perf_counter(), seconds))

    def autotuned(self, backend: str, seconds: float | None, configs: int) -> None:
        """An autotuning window of ``seconds`` that benchmarked ``configs`` configs (None
        seconds: answered from the disk cache); the JIT that ended inside it stays JIT."""
        times = self.times[backend]
        if seconds is None:
            times.autotune_cached += 1
            return
        since = time.perf_counter() - seconds
        inside = sum(s for end, s in self._jit_ends[backend] if end >= since)
        times.autotune_s += max(0.0, seconds - inside)
        times.configs_benchmarked += configs


def _each_clock(method: str, *args: Any) -> None:
    for clock in list(_CLOCKS):
        getattr(clock, method)(*args)


def _in_graph_compile() -> bool:
    """Whether Dynamo/Inductor is compiling a graph in this thread (its kernels are its own)."""
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def _install_triton() -> None:
    if "triton" in _INSTALLED or importlib.util.find_spec("triton") is None:
        return
    _INSTALLED.add("triton")
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton 3.4+: the listeners' home
    if knobs is None:
        return

    # the compilation listener came before the autotuning one (Triton 3.6 has only the first)
    has_tuning = hasattr(knobs.autotuning, "listener")
    compiled = knobs.compilation.listener
    tuned = knobs.autotuning.listener if has_tuning else None

    def on_compile(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool):
        if compiled is not None:
            compiled(
                src=src,
                metadata=metadata,
                metadata_group=metadata_group,
                times=times,
                cache_hit=cache_hit,
            )
        if not _in_graph_compile():
            _each_clock("jit", "triton", getattr(times, "total", 0) / 1e6, cache_hit)

    def on_autotune(**kwargs: Any) -> None:
        if tuned is not None:
            tuned(**kwargs)
        seconds = None if kwargs.get("cache_hit") else kwargs.get("duration")
        _each_clock("autotuned", "triton", seconds, len(kwargs.get("configs_timings") or ()))

    knobs.compilation.listener = on_compile
    if has_tuning:
        knobs.autotuning.listener = on_autotune


def _install_cute() -> None:
    """Time ``cute.compile`` and quack's autotuner where they are installed."""
    if "cute" in _INSTALLED or importlib.util.find_spec("cutlass") is None:
        return
    _INSTALLED.add("cute")
    import cutlass.cute as cute

    cute.compile = _TimedCompile(cute.compile)
    if importlib.util.find_spec("quack") is None:
        return
    from quack import autotuner

    for name in ("_bench", "_precompile"):
        if hasattr(autotuner.Autotuner, name):
            setattr(autotuner.Autotuner, name, _autotune_window(getattr(autotuner.Autotuner, name)))


class _TimedCompile:
    """``cute.compile`` with each call's time reported as CuTe DSL JIT; its other uses
    (options by subscript, attributes) forwarded unchanged."""

    def __init__(self, compile_fn: Any) -> None:
        self._compile = compile_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._compile(*args, **kwargs)
        finally:
            _each_clock("jit", "cute", time.perf_counter() - start, False)

    def __getitem__(self, item: Any) -> Any:
        return self._compile[item]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compile, name)


def _autotune_window(method: Any) -> Any:
    """quack's ``Autotuner._bench`` (one config benchmarked) or ``_precompile`` (configs
    compiled in worker processes), timed as an autotuning window."""
    configs = 1 if method.__name__ == "_bench" else 0

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _each_clock("autotuned", "cute", time.perf_counter() - start, configs)

    return timed
