"""A process-wide count of Triton kernel builds (compile, or load from the on-disk cache).

Triton calls ``knobs.runtime.jit_cache_hook`` when a kernel meets a specialization it has
not built in this process; a build inside serving is a step of hundreds of milliseconds. The
hook is Triton's one global, so the count is the process's (every engine in it), installed
once and chained to any hook set before (``benchmarks/compile_counter.py`` chains to it in turn).
Returning a false value lets Triton build as usual."""
from __future__ import annotations

_state = {"installed": False, "builds": 0, "prev": None, "names": []}


def _hook(*args, **kwargs):
    _state["builds"] += 1
    fn = kwargs.get("fn")
    if len(_state["names"]) < 200:
        _state["names"].append(getattr(fn, "name", "?"))
    prev = _state["prev"]
    return prev(*args, **kwargs) if prev is not None else None


def install() -> bool:
    """Start counting (idempotent). False: no Triton with build hooks here, nothing counted."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    _state["prev"] = runtime.jit_cache_hook
    runtime.jit_cache_hook = _hook
    _state["installed"] = True
    return True


def builds() -> int:
    """Builds counted since ``install``."""
    return _state["builds"]


def built_names(since: int = 0) -> list[str]:
    """Names of the kernels built, from the ``since``-th build on (the first 200 builds only)."""
    return list(_state["names"][since:])
