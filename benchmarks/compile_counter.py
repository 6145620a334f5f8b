"""Count Triton kernel builds and CUDA-graph captures inside a measured window.

A Triton build (compile, or load from the on-disk cache) happens the first time a kernel
meets a new specialization in this process; inside a timed run it shows up as a step of
hundreds of milliseconds. ``CompileCounter`` hooks Triton's ``jit_cache_hook`` (called only
on an in-memory cache miss) for the duration of a ``with`` block."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompileCounter:
    graphs: object | None = None
    """The runner's CudaGraphRunner (its captured-graph count is read), or None."""
    triton_builds: int = 0
    graph_captures: int = 0
    kernels: list[str] = field(default_factory=list)
    """Names of the kernels built (first 20)."""
    _knobs: object | None = None
    _prev_hook: object | None = None
    _graphs0: int = 0

    def __enter__(self) -> CompileCounter:
        try:
            from triton import knobs

            self._knobs = knobs.runtime
        except (ImportError, AttributeError):  # no Triton, or one without knobs: count nothing
            self._knobs = None
        if self._knobs is not None:
            self._prev_hook = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._hook
        self._graphs0 = len(self.graphs.graphs) if self.graphs is not None else 0
        return self

    def _hook(self, *args, **kwargs):
        self.triton_builds += 1
        fn = kwargs.get("fn")
        if len(self.kernels) < 20:
            self.kernels.append(getattr(fn, "name", "?"))
        return self._prev_hook(*args, **kwargs) if self._prev_hook else None

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._prev_hook
        if self.graphs is not None:
            self.graph_captures = len(self.graphs.graphs) - self._graphs0
