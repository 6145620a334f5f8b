"""A process-wide count of Triton kernel builds (compile, or load from the on-disk cache), and
the deferral that lets start-up build many kernels at once.

Triton calls ``knobs.runtime.jit_cache_hook`` when a kernel meets a specialization it has
not built in this process; a build inside serving is a step of hundreds of milliseconds. The
hook is Triton's one global, so the count is the process's (every engine in it), installed
once and chained to any hook set before (``benchmarks/compile_counter.py`` chains to it in turn).
Returning a false value lets Triton build as usual.

``deferring()``: while it is open, a build the hook sees is not done (a true return value:
Triton then neither builds nor launches that kernel) but recorded with its specialization data
(Triton's serialized signature, constants and options), once per specialization; ``build_all``
then builds the recorded ones on a thread pool (``JITFunction.preload`` under Triton's
``AsyncCompileMode``), after compiling them in worker processes where there are some
(``triton_workers``: a build's front end holds the GIL, so threads alone build mostly one after
another; the threads then load the workers' binaries from the on-disk cache). Deferred
specializations are not counted as builds; their later builds are.

Where the builds go on disk: Triton's cache directory (``cache_dir()``: ``TRITON_CACHE_DIR``,
default ``~/.triton/cache``); a later process finds a kernel there and loads it instead of
compiling it (a build that takes tens of milliseconds instead of seconds)."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from megatron_async.inference import triton_workers

_state = {"builds": 0, "prev": None, "names": [], "deferred": None, "deferring_thread": None, "seen": {},
          "compile_now": None}
_uncounted = threading.local()


@contextlib.contextmanager
def uncounted():
    """Builds in the calling thread inside this block are neither counted nor deferred: a
    background compile no step waits for (the IPC table copy's, ``weight_transfer/table_copy.py``)
    is not a kernel the warm-up missed."""
    _uncounted.on = True
    try:
        yield
    finally:
        _uncounted.on = False


def _hook(*args, **kwargs):
    if getattr(_uncounted, "on", False):
        prev = _state["prev"]
        return prev(*args, **kwargs) if prev is not None else None
    fn, data = kwargs.get("fn"), (kwargs.get("compile") or {}).get("specialization_data")
    jit = getattr(fn, "jit_function", None)
    if jit is not None and data is not None:
        _state["seen"].setdefault((id(jit), data), (jit, data))
    deferred = _state["deferred"]
    if deferred is not None and threading.get_ident() == _state["deferring_thread"]:
        if jit is not None and data is not None:
            if (id(jit), data) not in deferred:
                deferred[(id(jit), data)] = (jit, data)
                compile_now = _state["compile_now"]
                if compile_now is None or compile_now(jit, data):
                    with contextlib.suppress(Exception):  # the compile workers start on it now (none: no-op)
                        triton_workers.submit(jit, data)
            return True  # Triton skips this build and this launch
    _state["builds"] += 1
    fn = kwargs.get("fn")
    if len(_state["names"]) < 200:
        _state["names"].append(getattr(fn, "name", "?"))
    prev = _state["prev"]
    return prev(*args, **kwargs) if prev is not None else None


def install() -> bool:
    """Start counting (idempotent). False: no Triton with build hooks here, nothing counted.
    Installs again when someone replaced the hook since (chaining to theirs)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    if runtime.jit_cache_hook is _hook:
        return True
    _state["prev"] = runtime.jit_cache_hook
    runtime.jit_cache_hook = _hook
    return True


def builds() -> int:
    """Builds counted since ``install``."""
    return _state["builds"]


def seen() -> list:
    """Every (JITFunction, specialization data) the hook met since ``install``, built or deferred."""
    return list(_state["seen"].values())


def built_names(since: int = 0) -> list[str]:
    """Names of the kernels built, from the ``since``-th build on (the first 200 builds only)."""
    return list(_state["names"][since:])


def cache_dir() -> str | None:
    """Triton's on-disk kernel cache (None without Triton)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.cache.dir


@contextlib.contextmanager
def deferring(compile_now=None):
    """Record instead of build (see the module doc), in the calling thread only; yields the
    list the recorded (JITFunction, specialization data) pairs are in after the block.
    ``compile_now(jit, data)``: whether the compile workers start on a recorded one at once
    (None: every one; a ``host_builds.HostShare``'s ``mine``: this rank's own)."""
    if not install():
        yield []
        return
    if _state["deferred"] is not None:
        raise RuntimeError("triton_builds.deferring() is already open")
    found: dict = {}
    out: list = []
    _state["deferred"], _state["deferring_thread"] = found, threading.get_ident()
    _state["compile_now"] = compile_now
    try:
        yield out
    finally:
        _state["deferred"] = _state["deferring_thread"] = _state["compile_now"] = None
        out.extend(found.values())


@dataclass
class BuildReport:
    kernels: int
    """Specializations built (each a compile, or a load from the on-disk cache)."""
    threads: int
    seconds: float
    compiled: int = 0
    """Of which compiled in worker processes first (``triton_workers``): the threads loaded them."""
    processes: int = 0
    compile_seconds: float = 0.0
    slowest: tuple[str, float] = ("", 0.0)
    """The kernel whose compile in a worker took longest, and its seconds."""
    host: str = ""
    """With a ``host_builds.HostShare``: how the host's ranks split the builds (empty: no split)."""


def build_all(specs: list, threads: int, share=None) -> BuildReport:
    """``_build_all`` of ``specs``; with ``share`` (a ``host_builds.HostShare``), first this
    rank's share of them, then, once every rank of the job has built its own (``share.barrier``,
    reached even when there is nothing to build or the first part failed), the rest: loads from
    the on-disk cache, or compiles of what no other rank built."""
    if share is None:
        return _build_all(specs, threads)
    t0 = time.perf_counter()
    first, rest = share.split(specs)
    try:
        own = _build_all(first, threads)
    finally:
        t1 = time.perf_counter()
        share.barrier()
    wait = time.perf_counter() - t1
    loaded = _build_all(rest, threads)
    slowest = max(own.slowest, loaded.slowest, key=lambda s: s[1])
    host = (f"rank {share.index} of {share.count} on this host built {own.kernels} first, "
            f"{wait:.1f} s at the barrier, then {loaded.kernels} of the others'")
    return BuildReport(own.kernels + loaded.kernels, max(own.threads, loaded.threads), time.perf_counter() - t0,
                       own.compiled + loaded.compiled, max(own.processes, loaded.processes),
                       own.compile_seconds + loaded.compile_seconds, slowest, host)


def _build_all(specs: list, threads: int) -> BuildReport:
    """Build ``specs`` (from ``deferring``) on ``threads`` threads, then load each binary onto
    the current device (outside any graph capture). Each lands in its kernel's in-memory cache,
    so the first launch of that specialization finds it built. With compile workers
    (``triton_workers.start``) they compile there first, so the threads load them from disk."""
    t0 = time.perf_counter()
    if not specs:
        return BuildReport(0, 0, 0.0)
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    workers = triton_workers.compile_all(specs)
    threads = max(1, min(threads, len(specs)))
    kernels = []
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-build") as pool:
        with AsyncCompileMode(pool, ignore_errors=True):  # a failed one is built when first launched
            for jit, data in specs:
                with contextlib.suppress(Exception):
                    kernels.append(jit.preload(data))
    built = 0
    for kernel in kernels:
        wait = getattr(kernel, "result", None)  # a FutureKernel, finished when AsyncCompileMode closed
        compiled = wait(True) if callable(wait) else kernel
        init = getattr(compiled, "_init_handles", None)
        if init is not None:  # load the binary now: its first launch may be inside a graph capture
            init()
            built += 1
    return BuildReport(built, threads, time.perf_counter() - t0, workers.kernels, workers.processes, workers.seconds,
                       workers.slowest)
