"""Compile Triton kernels in worker processes, into Triton's on-disk cache.

A Triton build on threads is mostly serial: its front end (AST to TTIR, the MLIR passes) holds
the GIL, and only ptxas runs beside it. Worker processes compile side by side; each writes
its kernel to the cache directory (``triton_builds.cache_dir()``), and the engine's process
then builds the same specializations on its threads as before, each a load from that cache
(tens of milliseconds). A compile needs no GPU: the target (``GPUTarget("cuda", 90, 32)``)
comes with the specialization, so a worker never touches CUDA.

The workers are forked from the engine's process before CUDA is initialized (``start``, at
the start of ``LLM``): a fork after CUDA init must not use CUDA and forking a process with
tens of GiB mapped is slow, while an early fork also takes the workers' start off the critical
path (they start while the weights load). A spawned worker would import torch again (seconds).
Each worker imports a kernel's module on its first specialization of it.

A specialization a worker fails to compile (or any failure of the pool) is only slower: the
engine's process compiles it itself. The pool's tasks (names, JSON, the cache directory) travel
over pipes to the process's own forked children, never over a socket."""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch

from megatron_async.inference import host_builds

# the package's logger, not named in a string: the import-graph test reads a computed import_module
# (the kernel modules, below) as importing every module a string constant of this one names
log = logging.getLogger(__name__.split(".", 1)[0])

_pool: dict = {"pool": None, "size": 0, "pending": {}}
TIMEOUT_S = 600.0
"""A pass that takes longer is given up (a stuck worker): the engine's process compiles the kernels."""


def start(processes: int) -> int:
    """Fork ``processes`` compile workers (once per process; before CUDA is initialized).
    Returns how many there are (0: none, e.g. not Linux, no Triton, CUDA already initialized)."""
    if _pool["pool"] is not None or processes < 2:
        return _pool["size"]
    try:
        import triton  # noqa: F401 -- the workers inherit it imported
    except ImportError:
        return 0
    if torch.cuda.is_initialized() or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    if multiprocessing.current_process().daemon:  # a daemonic process (a rank spawned by a pool) cannot fork workers
        return 0
    settle_kernel_hashes()
    try:
        _pool["pool"] = multiprocessing.get_context("fork").Pool(processes, initializer=_worker_init)
    except OSError as e:
        log.info("Triton compile workers not started (%s): kernels compile on threads", e)
        return 0
    _pool["size"] = processes
    return processes


def settle_kernel_hashes() -> int:
    """Compute the source hash (``JITFunction.cache_key``) of every Triton function of the
    package's kernel modules now, before this process compiles anything and before the workers
    fork: they inherit them. Triton computes a function's hash the first time it is needed, and
    with Triton 3.6 the sampler's kernels (which call libdevice) hashed differently in a worker
    that had compiled other kernels first (measured on an H100: the workers and the engine's
    process named 25 of a cold start's 74 specializations by different cache keys, two workers
    even differently from each other, and the engine's threads compiled those 25 a second time:
    ~2.5 s). Returns how many functions it hashed (those already hashed count too)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from megatron_async import kernels

    hashed = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        name = f"{kernels.__name__}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- an optional backend's module: its kernels hash when first used
            continue
        for value in list(vars(module).values()):
            for _ in range(3):  # autotune / heuristics wrappers hold the JITFunction as .fn
                if isinstance(value, JITFunction) or not hasattr(value, "fn"):
                    break
                value = value.fn
            if isinstance(value, JITFunction) and value.__module__ == name:
                value.cache_key  # noqa: B018 -- computed and kept by Triton
                hashed += 1
    return hashed


@contextlib.contextmanager
def running(device: torch.device, threads: int | None, workers: bool = True):
    """Compile workers for a block that builds an engine on ``device`` (CUDA; ``threads``: its
    ``startup_build_threads``; fewer than 2: none; ``workers``: its ``startup_compile_workers``,
    False: none), ended after it."""
    wanted = workers and device.type == "cuda" and _pool["pool"] is None
    started = start(build_threads(threads)) if wanted else 0
    try:
        yield
    finally:
        if started:
            stop()


def build_threads(asked: int | None) -> int:
    """The start-up's Triton build threads (and compile workers) for ``startup_build_threads``:
    as asked, or, when None, this process's share of the cores it may use (torchrun's ranks of
    one host start up at once and split them: ``LOCAL_WORLD_SIZE``), at most 16."""
    if asked is not None:
        return asked
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks = host_builds.local_ranks()
    return max(1, min(16, cores // (ranks[1] if ranks is not None and ranks[1] > 0 else 1)))


def stop() -> None:
    """End the workers (after the warm-up: nothing compiles at start-up any more)."""
    pool, _pool["pool"], _pool["size"] = _pool["pool"], None, 0
    _pool["pending"].clear()
    if pool is not None:
        pool.terminate()
        pool.join()


def size() -> int:
    return _pool["size"]


@dataclass
class CompileReport:
    kernels: int = 0
    """Specializations a worker compiled (or found in the cache already)."""
    processes: int = 0
    seconds: float = 0.0
    slowest: tuple[str, float] = ("", 0.0)
    """The kernel whose compile took longest, and its seconds: the pass takes at least as long."""


def submit(jit, data) -> None:
    """Start compiling one specialization now (the dry pass hands each over as it records it, so
    the compiles run beside the rest of the pass); ``compile_all`` waits for it."""
    pool = _pool["pool"]
    if pool is None or (id(jit), data) in _pool["pending"]:
        return
    from triton import knobs
    from triton.runtime.jit import get_cache_invalidating_env_vars

    task = (jit.module, jit.fn.__qualname__, _with_target(data), knobs.cache.dir, get_cache_invalidating_env_vars())
    _pool["pending"][(id(jit), data)] = (task, pool.apply_async(_compile, (task,)))


def _current_target() -> dict:
    from triton.runtime import driver

    return dict(driver.active.get_current_target().__dict__)


def _with_target(data: str) -> str:
    """``data`` naming the GPU target it compiles for: Triton before 3.7 (3.6 is the CUDA 13
    wheels' pin) serializes a specialization without one (its preload compiles for the current
    device), and a worker has no device: it gets this process's. Data it cannot read passes as is."""
    try:
        spec = json.loads(data)
        if not isinstance(spec, dict) or "target" in spec:
            return data
        spec["target"] = _current_target()
        return json.dumps(spec)
    except Exception:  # noqa: BLE001 -- the worker reports what it cannot compile; the threads build it
        return data


def compile_all(specs: list) -> CompileReport:
    """Compile ``specs`` ((JITFunction, specialization data) pairs, ``triton_builds.deferring``)
    on the workers into the on-disk cache (those ``submit`` started already are waited for);
    returns when all are done (0 kernels: no workers). ``seconds``: the wait."""
    if _pool["pool"] is None or not specs:
        return CompileReport()
    t0, deadline = time.perf_counter(), time.monotonic() + TIMEOUT_S
    try:
        for jit, data in specs:
            submit(jit, data)
        jobs = [_pool["pending"].pop((id(jit), data)) for jit, data in specs]
        done = [job.get(max(0.0, deadline - time.monotonic())) for _, job in jobs]
    except Exception as e:  # noqa: BLE001 -- a broken or stuck pool: the engine's process compiles them
        log.info("Triton compile workers failed (%s): kernels compile on threads", e)
        stop()
        return CompileReport()
    failed = [error for error, _ in done if error]
    if failed:
        log.info("%d of %d Triton kernels failed to compile in a worker (they compile on threads); first: %s",
                 len(failed), len(done), failed[0])
    slowest = max(((task[1], sec) for (task, _), (_, sec) in zip(jobs, done)), key=lambda x: x[1])
    return CompileReport(len(done) - len(failed), _pool["size"], time.perf_counter() - t0, slowest)


def _warm_kernel(x_ptr, n, BLOCK: "tl.constexpr"):  # noqa: F821 -- compiled by _worker_init only
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # noqa: F821
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)  # noqa: F821


def _worker_init() -> None:
    """Ignore Ctrl-C (it ends the engine's process, which ends the pool), and compile a small
    kernel into a throw-away cache now, while the engine's process loads its weights: a
    process's first compile sets the compiler up (~0.4 s on the CPU box), not the first real one."""
    import signal
    import tempfile

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cache = os.environ.get("TRITON_CACHE_DIR")
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource

        globals()["tl"] = tl
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["TRITON_CACHE_DIR"] = tmp
            src = ASTSource(triton.jit(_warm_kernel), {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128})
            triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception:  # noqa: BLE001 -- only a warm-up (no CUDA backend, an interpreted Triton)
        pass
    finally:
        if cache is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = cache


def jit_function(key: str):
    """The JITFunction named ``module:qualname``: Triton's registry where it holds it (3.9+), else
    the module's attribute (Triton 3.6 keeps no registry; the kernels are module-level names)."""
    import importlib

    module, qualname = key.split(":", 1)
    try:
        from triton.runtime.jit import _triton_jit_function_registry as registry
    except ImportError:
        registry = {}
    if key in registry:
        return registry[key]
    found = importlib.import_module(module)
    if key in registry:
        return registry[key]
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _build_launcher(src, kernel) -> None:
    """Build the kernel's host-side launcher here too: where Triton compiles one in C per kernel
    signature (3.6), that compiler run lands in the same on-disk cache and the engine's process only
    loads it (a compiler run a kernel there before). A failure is only slower: the process builds it."""
    with contextlib.suppress(Exception):
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(src, kernel.metadata)


def _compile(task) -> tuple[str, float]:
    """In a worker: compile one specialization (what ``JITFunction.preload`` does, with the
    target from the specialization instead of the current device). Returns ("" or the error, seconds)."""
    module, qualname, data, cache_dir, env_vars = task
    t0 = time.perf_counter()
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource, make_backend
        from triton.runtime.jit import convert_to_tuple_if_list

        os.environ["TRITON_CACHE_DIR"] = cache_dir
        jit = jit_function(f"{module}:{qualname}")
        spec = json.loads(data)
        target = GPUTarget(**spec["target"])
        backend = make_backend(target)

        def decode(value):
            if tl.dtype.is_dtype(value):
                return tl.dtype(value)
            if isinstance(value, dict) and "constexpr" in value:
                return tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
            if isinstance(value, dict) and "jit_function" in value:
                return jit_function(value["jit_function"])
            return convert_to_tuple_if_list(value)

        constexprs = {tuple(k): decode(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
        signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
        options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()})
        extra = {"_env_vars": env_vars} if "_env_vars" in inspect.signature(triton.compile).parameters else {}
        src = ASTSource(jit, signature, constexprs, attrs)
        _build_launcher(src, triton.compile(src, target=target, options=options.__dict__, **extra))
        return "", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 -- the engine's process compiles it (and raises there if it must)
        return f"{qualname}: {type(e).__name__}: {e}", time.perf_counter() - t0
