"""Triton compile workers: forked processes compile a kernel's specializations for an explicit
GPU target (no GPU needed) into Triton's on-disk cache, where the engine's process then finds
them: its own compile of the same specialization is a load, not a compile."""
import os
from pathlib import Path

import pytest
import torch

from megatron_async.inference import triton_builds, triton_workers

triton = pytest.importorskip("triton")


CHECK = """
import inspect, json, os, sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import get_cache_invalidating_env_vars, serialize_specialization_data

from megatron_async.inference import triton_workers


@triton.jit
def scale(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)


try:  # three specializations for an H100, serialized as Triton's build hook hands them over
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({})
except Exception as e:
    print(json.dumps({"skip": str(e)}))
    sys.exit(0)
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr", "BLOCK": "constexpr"}
attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
consts = [{(3,): i + 2, (4,): 256} for i in range(3)]
with_target = [target] if len(inspect.signature(serialize_specialization_data).parameters) > 6 else []
specs = [(scale, serialize_specialization_data("scale", sig, c, attrs, options, str(i), *with_target))
         for i, c in enumerate(consts)]
# Triton 3.6 serializes no target (3.9 does): the worker compiles for the engine process's device
untargeted = json.loads(specs[2][1])
untargeted.pop("target", None)
specs[2] = (scale, json.dumps(untargeted))
triton_workers._current_target = lambda: dict(target.__dict__)
workers = triton_workers.start(2)
triton_workers.submit(*specs[0])  # as the dry pass hands one over when it records it
report = triton_workers.compile_all(specs)
pending = len(triton_workers._pool["pending"])
triton_workers.stop()
cache = os.environ["TRITON_CACHE_DIR"]
entries = sorted(os.listdir(cache))
for c in consts:  # what JITFunction.preload compiles in the engine's process
    env = ({"_env_vars": get_cache_invalidating_env_vars()}
           if "_env_vars" in inspect.signature(triton.compile).parameters else {})
    triton.compile(ASTSource(scale, sig, c, attrs), target=target, options=options.__dict__, **env)
print(json.dumps({"workers": workers, "compiled": report.kernels, "pending": pending, "entries": entries,
                  "after": sorted(os.listdir(cache))}))
"""


def test_workers_compile_into_the_cache_the_engine_process_loads_from(tmp_path):
    """In a process of its own: the suite runs Triton interpreted, the engine compiled."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    (tmp_path / "check.py").write_text(CHECK)  # Triton reads a kernel's source from its file
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(tmp_path / "check.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"no CUDA compiler backend: {out['skip']}")
    assert out["workers"] == 2 and out["compiled"] == 3 and out["pending"] == 0  # the submitted one counted once
    assert len(out["entries"]) == 3  # one cache directory per kernel
    assert out["after"] == out["entries"]  # each found in the cache: nothing compiled again


@pytest.fixture
def workers():
    if torch.cuda.is_initialized():  # a GPU run's earlier tests: workers fork only before CUDA is set up
        pytest.skip("CUDA is initialized in this process: no compile workers")
    assert triton_workers.start(2) == 2
    yield
    triton_workers.stop()
    assert triton_workers.size() == 0


def test_a_specialization_a_worker_cannot_compile_is_left_to_the_engine_process(workers):
    class Stranger:  # no module Triton knows: the worker fails it, build_all's threads build it
        module, loaded = "no_such_module_here", []

        class fn:
            __qualname__ = "k"

        def preload(self, data):
            loaded = self.loaded

            class Compiled:
                def _init_handles(self):
                    loaded.append(data)

            return Compiled()

    report = triton_builds.build_all([(Stranger(), "{}"), (Stranger(), "[]")], threads=2)
    assert report.processes == 2 and report.compiled == 0
    assert report.kernels == 2 and sorted(Stranger.loaded) == ["[]", "{}"]


def test_no_workers_on_cpu_nor_switched_off_nor_after_cuda_init(monkeypatch):
    with triton_workers.running(torch.device("cpu"), 4):
        assert triton_workers.size() == 0
    with triton_workers.running(torch.device("cuda"), 4, workers=False):  # startup_compile_workers=False
        assert triton_workers.size() == 0
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert triton_workers.start(4) == 0 and triton_workers.size() == 0
    assert triton_workers.compile_all([]).kernels == 0


def test_a_failing_hand_over_leaves_every_kernel_to_the_threads(workers, monkeypatch):
    def broken(jit, data):
        raise ImportError("an older Triton")

    monkeypatch.setattr(triton_workers, "submit", broken)
    assert triton_workers.compile_all([(object(), "{}")]).kernels == 0
    assert triton_workers.size() == 0  # given up for the rest of the start-up


SETTLE = """
from megatron_async.inference import triton_workers
from megatron_async.kernels import triton_sampling, triton_threshold
assert triton_sampling._draw_kernel.hash is None and triton_threshold._stage_init_kernel.hash is None
n = triton_workers.settle_kernel_hashes()
print(n, triton_sampling._draw_kernel.hash, triton_threshold._stage_init_kernel.hash)
"""


def test_kernel_hashes_are_settled_before_the_workers_fork():
    """``start`` hashes every kernel module's Triton functions before forking, so the workers
    inherit the engine process's hashes (a fresh process: nothing hashed before the call)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, as on a GPU
    r = subprocess.run([sys.executable, "-c", SETTLE], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    n, draw, stage = r.stdout.split()
    assert int(n) > 50 and len(draw) == 64 and len(stage) == 64


def _start_in_daemon(results) -> None:
    results.put(triton_workers.start(2))


def test_no_workers_in_a_daemonic_process():
    """A rank spawned as a daemonic child (a benchmark's or a test's process pool) cannot fork
    compile workers: ``start`` gives none instead of failing the engine's construction."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_start_in_daemon, args=(results,), daemon=True)
    child.start()
    started = results.get(timeout=120)
    child.join(timeout=60)
    assert started == 0 and child.exitcode == 0
