"""Build a warm-up's Triton kernels at once instead of one after another.

A kernel is built the first time a step launches it with a new specialization, so running the
warm-up's steps builds them in sequence: ~40 builds of 0.3-2 s each on a fresh machine. Worker
processes compile them side by side (threads alone do not: a build's front end holds the GIL);
what they need is the list of specializations before any step runs. A step's specializations
depend only on host values (its shape, the tensors' dtypes, strides and alignment), never on
what earlier kernels computed, so the list comes from steps that do not run: each warm-up shape
is captured into a CUDA graph that is then thrown away (nothing in a capture executes), with
Triton's build hook deferring every unbuilt kernel (``triton_builds.deferring``: not built, not
launched, recorded). ``triton_builds.build_all`` then builds the recorded ones (compiled in
worker processes where there are some, ``triton_workers``) and loads them onto the device.

A capture only records: writes to the engine's buffers (samples, drafts, the dummy KV block) do
not happen, and a tensor that compute_step would keep beyond the step would be left unwritten.
The engine keeps no such tensor (its buffers are allocated up front, graph-safe); the device
memory allocated before and after each capture is compared, and a shape whose capture keeps
memory, or fails to capture (a step that needs the host mid-way), ends the dry pass: those
shapes and the rest run for real, as without prebuilding.

The memory profile's probe context (two KV blocks, every other size as the engine's) captures the
warm-up's shapes in its own pass (memory_profiling.py): no kernel's specialization depends on the
pool's block count (kernel_list.kv_layout). The warm-up then passes them as ``built_before`` and
captures only two again, as the check that its context launches nothing the probe's did not.

A dry capture runs only the prefix of the model's blocks that stands for all of them
(``dry_blocks.py``: 4 of the 0.6B's 56). A pass first captures its largest decode and mixed shape
with the prefix, then with every block, and drops the prefix when the second meets a
specialization the first did not; those two shapes count as captured. A pass that checks an
earlier one (``built_before``) runs every block.

Libraries that set themselves up on first use must not do it inside a capture: cuBLAS creates
its handle on the process's first matmul (``cublasCreate`` fails inside a capture, which is then
invalidated), and torch gives each (handle, stream) its own workspace. The memory
profile's dry capture holds the process's first matmul, so ``warm_libraries`` runs a few small
matmuls on the capture stream first; one capture stream per device serves every dry pass."""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from megatron_async.inference import triton_builds
from megatron_async.inference.text_generation_controllers.dry_blocks import blocks_to_run

log = logging.getLogger("megatron_async")


@dataclass
class PrebuildReport:
    kernels: int = 0
    """Specializations built on the thread pool (compiled, or loaded from Triton's disk cache)."""
    threads: int = 0
    seconds: float = 0.0
    """Wall time: the dry captures plus the builds."""
    build_seconds: float = 0.0
    """Of which the threaded builds."""
    shapes: int = 0
    """Warm-up shapes captured dry."""
    left: list = field(default_factory=list)
    """Shapes that must still run for real: from the first that failed to capture dry on."""
    compiled: int = 0
    """Of ``kernels``, compiled in worker processes first (``triton_workers``; the threads loaded them)."""
    processes: int = 0
    compile_seconds: float = 0.0
    """Of ``build_seconds``, the workers' compiles."""
    slowest: tuple[str, float] = ("", 0.0)
    """The kernel whose compile in a worker took longest, and its seconds."""
    listed: bool = False
    """Built from the list an earlier process kept (kernel_list.py): nothing captured dry."""
    specs: list = field(default_factory=list)
    """Every specialization the process had met when the dry pass ended (what a kept list holds)."""
    covered: list = field(default_factory=list)
    """The ``(shape, width)`` pairs whose kernels are built now: those captured dry, or all of a kept list's."""
    assumed: int = 0
    """Shapes not captured, their kernels built by an earlier pass (``built_before``), after a check."""
    host: str = ""
    """How the host's ranks split the builds (``host_builds``; empty: this rank built all it recorded)."""

    @classmethod
    def of(cls, built, seconds: float, shapes: int, left: list, **kw) -> "PrebuildReport":
        """The report of a pass whose builds were ``built`` (a ``triton_builds.BuildReport``)."""
        return cls(built.kernels, built.threads, seconds, built.seconds, shapes, left, built.compiled, built.processes,
                   built.compile_seconds, built.slowest, host=built.host, **kw)

    def describe(self) -> str:
        steps = "the kept kernel list" if self.listed else f"{self.shapes} step{'s' * (self.shapes != 1)} captured dry"
        if self.assumed:
            steps += f" ({self.assumed} more built before)"
        if not self.listed:  # what the dry captures themselves took (Python, mostly)
            steps += f" in {self.seconds - self.build_seconds:.1f} s"
        workers = (f" ({self.compiled} compiled in {self.processes} processes in {self.compile_seconds:.1f} s, longest "
                   f"{self.slowest[0]} {self.slowest[1]:.1f} s)" if self.processes else "")
        return (f"{steps}, {self.kernels} kernels on {self.threads} threads in {self.build_seconds:.1f} s"
                + workers + (f"; {self.host}" if self.host else ""))


_MATMUL_DTYPES = {torch.float16, torch.bfloat16, torch.float32}
_capture_streams: dict = {}


def capture_stream(device: torch.device):
    """The dry captures' stream on ``device``: one for every pass, so cuBLAS keeps one workspace for it."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device=index)
    return _capture_streams[index]


def warm_libraries(model, stream) -> None:
    """Set cuBLAS up for ``stream`` outside any capture: a matmul (the handle, and the workspace
    torch gives each stream) and one with a bias (cuBLASLt's handle) in each of the model's float
    dtypes. Without it the memory profile's dry capture, the process's first matmul, fails."""
    dtypes = {p.dtype for p in model.parameters()} & _MATMUL_DTYPES | {torch.float32}
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for dtype in dtypes:
            a = torch.ones(16, 16, dtype=dtype, device=stream.device)
            torch.mm(a, a)
            torch.addmm(a[0], a, a)
    stream.synchronize()


def _keep() -> None:
    pass


@contextlib.contextmanager
def caches_kept(empty_after: bool = True):
    """``torch.cuda.graph`` empties the allocator's device and pinned-host caches before each
    capture: over hundreds of captures every eager run then allocates its workspace again (and
    re-pins host buffers). Kept through a warm-up's captures (the memory plan counts the eager
    cache's peak beside the graph pool), emptied once after them (``empty_after``; a dry pass
    empties them itself once its graphs are gone)."""
    device, host = torch.cuda.empty_cache, getattr(torch._C, "_host_emptyCache", None)  # the latter: CUDA builds
    torch.cuda.empty_cache = _keep
    if host is not None:
        torch._C._host_emptyCache = _keep
    try:
        yield
    finally:
        torch.cuda.empty_cache = device
        if host is not None:
            torch._C._host_emptyCache = host
    if empty_after and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _dry_capture(runner, shape, stream, pool, kept: int | None, graphs: list,
                 blocks: list[int] | None = None) -> int | None:
    """Capture ``shape`` into a graph that is never replayed, held in ``graphs`` until the pass
    ends: the dry captures share one pool, and a pool whose last graph is dropped cannot take
    another capture (torch's allocator asserts its use count is above zero). Returns the device
    memory allocated after it, None when it cannot be captured or kept more than ``kept`` (the
    memory after the first dry capture, which may keep cuBLAS's workspace for the capture stream).
    A verify step's width changes nothing captured here: ``shape`` alone."""
    ctx = runner.context
    if shape.any_penalties:
        before = torch.cuda.memory_allocated()
        ctx.sampling_state.ensure_allocated()
        if kept is not None:  # the penalties' state is the engine's, not the capture's
            kept += torch.cuda.memory_allocated() - before
    # No padding snapshot first: nothing captured here runs, so what the device view holds does not
    # matter (a snapshot and its copy took ~14 ms a capture beside the compile workers)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # never replayed: not instantiated
    ok = True
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            runner.model.dry_blocks = blocks
            try:
                runner.compute_step(shape)  # outputs dropped at once
            finally:
                runner.model.dry_blocks = None
    except Exception as e:  # noqa: BLE001 -- any capture failure: the shape runs for real
        first = e.__context__  # the op that invalidated the capture, when capture_end's error replaced it
        log.info("start-up build: a %d-token step cannot be captured dry (%s%s); it runs for real", shape.num_tokens,
                 e, f"; first: {type(first).__name__}: {first}" if first is not None else "")
        end_failed_capture(pool)
        ok = False
    else:
        graphs.append(graph)
    del graph
    now = torch.cuda.memory_allocated()
    if ok and kept is not None and now > kept:
        log.warning("start-up build: a dry %d-token step kept %d bytes of device memory; the rest of the warm-up runs "
                    "for real", shape.num_tokens, now - kept)
        ok = False
    return now if ok else None


def end_failed_capture(pool) -> bool:
    """Undo a failed capture's hold on the allocator. torch's capture_end stops routing
    allocations to the capture's pool only after cudaStreamEndCapture succeeds, and a graph
    releases its pool only once it holds a graph: a capture that failed stays listed as
    underway, so every later ``torch.cuda.empty_cache()`` skips the event-pending blocks and
    the next MemPool that is destroyed (torch-memory-saver's, at the latest at exit) aborts the
    process on the allocator's "captures_underway.empty()" assertion. Returns whether there
    was anything to undo (False when capture_end got as far as ending it)."""
    dev = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(dev, pool)
    except RuntimeError:  # "not currently recording to mempool_id": capture_end did it
        return False
    torch._C._cuda_releasePool(dev, pool)  # the reference capture_begin took
    return True


def shape_key(pair) -> str:
    """A ``(StepShape, width)`` pair as ``built_before`` names it."""
    return repr(pair)


def _largest_decode_and_mixed(shapes: list) -> list:
    """The largest decode-only and the largest mixed ``(StepShape, width)`` pair of ``shapes`` (those there are)."""
    groups = ([s for s in shapes if s[0].is_decode_only], [s for s in shapes if not s[0].is_decode_only])
    return [max(group, key=lambda s: s[0].num_tokens) for group in groups if group]


def _check_first(shapes: list, built_before) -> tuple[list, int, list]:
    """(shapes to capture, how many of them check, shapes assumed built): the largest decode and
    the largest mixed shape ``built_before`` names come first, as the check; the rest it names
    are assumed."""
    known = [s for s in shapes if shape_key(s) in built_before]
    checks = _largest_decode_and_mixed(known)
    assumed = [s for s in known if s not in checks]
    return checks + [s for s in shapes if shape_key(s) not in built_before], len(checks), assumed


def _check_blocks(runner, pairs: list, reps: list[int], stream, pool, graphs: list):
    """Capture ``pairs`` (the largest decode and mixed shape) with only the ``reps`` blocks, then
    with every block: (memory after, the blocks to run from now on: ``reps``, or None when every
    block met a specialization the ``reps`` did not). (False, _): a capture failed, the pass ends."""
    kept = None
    for blocks in (reps, None):
        if blocks is None:
            met = len(triton_builds.seen())
        for pair in pairs:
            kept = _dry_capture(runner, pair[0], stream, pool, kept, graphs, blocks)
            if kept is None:
                return False, None
    if len(triton_builds.seen()) > met:
        log.info("start-up build: the model's blocks %s do not stand for the others; dry captures run every block",
                 reps)
        return kept, None
    return kept, reps


@torch.inference_mode()
def prebuild(runner, shapes: list, threads: int, also=None, built_before=frozenset(), share=None) -> PrebuildReport:
    """Find the Triton specializations of ``shapes`` (``(StepShape, verify width)`` pairs, as
    ``warmup.eager_shapes``) without running them and build them on ``threads`` threads.
    ``also``: a callable run eagerly (not captured) inside the deferral, whose kernels are built
    with the rest; its unbuilt kernels do not launch, so it may only compute what it throws away.
    ``built_before``: ``shape_key``s of shapes whose kernels an earlier dry pass of this model built
    (the memory profile's, on its probe context): two of them (the largest decode and mixed
    shapes) are captured again as a check, and the others only if that check met a
    specialization the process had not (a context that launches other kernels than the probe's).
    ``share``: the host's ranks split the builds (``host_builds.HostShare``; every rank of the
    job must then call this at once). Nothing may be in flight. The view and the latest samples are as before."""
    t0 = time.perf_counter()
    order, checks, assumed = _check_first(shapes, built_before)
    ctx = runner.context
    saved_view, saved_samples = ctx.gpu_view.buffer.clone(), runner.last_samples.clone()
    stream, pool = capture_stream(runner.device.device), torch.cuda.graph_pool_handle()
    warm_libraries(runner.model, stream)
    gc.collect()  # no collection of earlier engines' graphs inside a capture
    gc_on = gc.isenabled()
    gc.disable()
    done, kept, graphs = 0, None, []
    reps = None  # every block; a prefix only in a pass that checks it (not one checking an earlier pass)
    if hasattr(runner.model, "blocks") and not checks:
        reps = blocks_to_run(runner.model.blocks)
        reps = reps if len(reps) < len(runner.model.blocks) else None
    try:
        with (triton_builds.deferring(share.mine if share is not None else None) as specs,
              caches_kept(empty_after=False)):  # emptied below, the graphs gone
            if reps is not None:  # do the blocks run stand for the rest? (else: every block)
                checked = _largest_decode_and_mixed(shapes)
                kept, reps = _check_blocks(runner, checked, reps, stream, pool, graphs)
                if kept is not False:  # its shapes are captured: first in the order, done
                    order = checked + [s for s in order if s not in checked]
                    done = len(checked)
            met = len(triton_builds.seen())
            while kept is not False and done < len(order):
                kept = _dry_capture(runner, order[done][0], stream, pool, kept, graphs, reps)
                if kept is None:
                    break
                done += 1
                if done == checks and assumed and len(triton_builds.seen()) > met:
                    log.info("start-up build: this context meets kernels the earlier dry pass did not; capturing "
                             "its %d other shapes too, every block", len(assumed))
                    order[done:done] = assumed
                    assumed = []
            if also is not None:
                also()
    finally:
        if gc_on:
            gc.enable()
    ctx.gpu_view.buffer.copy_(saved_view)
    runner.last_samples.copy_(saved_samples)
    torch.cuda.synchronize()
    del pool, graphs
    gc.collect()
    torch.cuda.empty_cache()  # the dry captures' pool: nothing in it is kept
    built = triton_builds.build_all(specs, threads, share)
    left = order[done:]
    if done < checks:  # the check did not capture: nothing assumed, the rest run for real
        left, assumed = left + assumed, []
    return PrebuildReport.of(built, time.perf_counter() - t0, done, left, specs=triton_builds.seen(),
                             covered=order[:done] + assumed, assumed=len(assumed))
