"""The kernels a start-up's dry pass found, kept beside Triton's on-disk cache for the next
process of the same configuration (with ``InferenceConfig.startup_kernel_lists``, which the main
job turns on for its ``--kernel-cache-dir``: a cache directory the user keeps).

A warm start (every kernel in Triton's cache) still spent its dry captures finding which
specializations to load: ~50 ms a shape, 2.9 s for the H100 main job's 58 warm-up shapes. Once
a dry pass captured every shape, every specialization the process has met so far (the build
hook's record: built before, or deferred by this pass) is written to
``<cache_dir>/megatron_async_kernels/<key>.json``; a later start-up with the same key builds that
list at once (loads from the cache) and captures nothing dry. The key hashes what a
specialization depends on: the shapes, the model's parameters (names, shapes, dtypes), the
context's sizes and KV cache layout, the kernel choices, the device, torch's and Triton's versions,
the package's source and, under TP / EP, the ranks and their P2P collectives. A list holds more
than the pass needs rather than less (an extra kernel is a load); one that still missed a
specialization would only build it when first launched (``EngineStats.triton_builds_after_warmup``
counts it); an unreadable list is ignored."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from megatron_async.inference import triton_builds
from megatron_async.inference.host_builds import HostShare, host_share
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport, prebuild
from megatron_async.parallel.dry_exchange import ep_state
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")

_PACKAGE = Path(__file__).resolve().parents[2]
_source_hash: list[str] = []


def _package_source() -> str:
    """A hash of every Python file of the package (once per process)."""
    if not _source_hash:
        h = hashlib.sha256()
        for path in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _source_hash.append(h.hexdigest())
    return _source_hash[0]


def kv_layout(kv_caches: list) -> str:
    """The KV pools' shapes and dtypes without their block count: the memory plan sizes the pool
    from the free memory it measures, which moves by a few blocks between processes (40,312 and
    40,352 on one H100), and no kernel's specialization depends on it (the kernels take a layer's
    pool by its block size, heads and head dim and by strides that are multiples of those)."""
    return repr([(tuple(t.shape[:1]) + tuple(t.shape[2:]), str(t.dtype)) for t in kv_caches])


def list_key(runner, shapes: list) -> str:
    import triton

    ctx, model = runner.context, runner.model
    dev = ctx.device.device
    parts = [
        repr(shapes), type(model).__name__, repr(getattr(model, "kernels", None)), repr(runner.batch_invariant),
        repr([(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]),
        kv_layout(ctx.kv_caches),
        repr((ctx.max_requests, ctx.max_tokens, ctx.max_sequence_length, ctx.num_speculative_tokens, ctx.block_size,
              ctx.batch_invariant, ctx.mamba is not None)),
        torch.cuda.get_device_name(dev), repr(torch.cuda.get_device_capability(dev)), torch.__version__,
        triton.__version__, _package_source(), _parallel(model),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _parallel(model) -> str:
    """What of TP / EP a rank's kernels depend on: its ranks (an integer argument of 1 specializes
    apart), the groups' sizes and whether the P2P collectives take their Triton kernels (the fused
    all-reduce's two-shot one included: its self-test at load may turn it off)."""
    p = rank_state(model)
    if p is None:
        return ""
    fused = p.tp_reducer is not None and p.tp_reducer.fused_max_bytes > 0
    two_shot = fused and p.tp_reducer.peers.second_barrier
    return repr((p.tp_rank, p.tp_size, fused, two_shot, p.ep_rank, p.ep_size, p.ep_exchange.value,
                 p.ep_exchanger is not None))


def rank_state(model) -> ParallelState | None:
    """The ``ParallelState`` of a model run by several ranks of one job (TP and / or EP; None: one rank)."""
    p = ep_state(model) or model.__dict__.get("parallel")
    return p if isinstance(p, ParallelState) and p.world_size > 1 else None


def build_share(runner) -> HostShare | None:
    """This rank's part of its host's builds when the job's ranks start up together (TP / EP: every
    rank runs the same dry passes at once); None: it builds all it records."""
    p = rank_state(runner.model)
    return host_share(p.world_size, runner.device.device) if p is not None else None


def list_path(runner, shapes: list) -> Path | None:
    """Where the list for ``shapes`` on ``runner`` is kept (None: the runner's ``kernel_lists`` off,
    or no cache directory)."""
    cache = triton_builds.cache_dir() if runner.kernel_lists else None
    return Path(cache) / "megatron_async_kernels" / f"{list_key(runner, shapes)}.json" if cache else None


def _read(path: Path) -> list | None:
    """The (JITFunction, specialization data) pairs of a written list; None: none, or unreadable."""
    from megatron_async.inference.triton_workers import jit_function

    try:
        entries = json.loads(path.read_text())["kernels"]
        return [(jit_function(key), data) for key, data in entries]
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 -- a stale or foreign list: find the kernels again
        log.info("start-up build: kernel list %s not used (%s); capturing dry instead", path, e)
        return None


def _write(path: Path, specs: list) -> None:
    entries = [[f"{jit.module}:{jit.fn.__qualname__}", data] for jit, data in specs]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"kernels": entries}))
        tmp.replace(path)  # atomic: a process reading it never sees half a list
    except OSError as e:
        log.info("start-up build: kernel list %s not written (%s)", path, e)


def prebuild_listed(runner, shapes: list, threads: int, also=None, built_before=frozenset(),
                    share=None) -> PrebuildReport:
    """``kernel_prebuild.prebuild`` (writing its list when it captured every shape), or the build
    of the list an earlier process of the same key kept (no dry capture; ``listed``). ``share``:
    the host's ranks split the builds either way (``host_builds.HostShare``)."""
    path = list_path(runner, shapes)
    specs = _read(path) if path is not None else None
    if specs is not None:
        t0 = time.perf_counter()
        built = triton_builds.build_all(specs, threads, share)
        return PrebuildReport.of(built, time.perf_counter() - t0, 0, [], listed=True, covered=list(shapes))
    report = prebuild(runner, shapes, threads, also, built_before, share)
    if path is not None and not report.left:
        _write(path, report.specs)
    return report
