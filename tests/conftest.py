"""Suite-wide settings: single-threaded torch (2 threads make CPU timings jump), no hub, a runtime
directory of the suite's own, and without CUDA the Triton interpreter (with a row-independent
tl.dot, device-function calls that do not re-patch the language, a cached dtype lookup and block
types built once per shape)."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Coordinators keep their secret and socket files, clients their reply sockets, under
# XDG_RUNTIME_DIR (~/.cache without it): the suite and every process it starts use a directory
# of their own, removed at the end, so processes a test kills leave nothing in the user's and no
# test meets a real coordinator's files.
_RUNTIME_DIR = tempfile.mkdtemp(prefix="ma-run-")
os.environ["XDG_RUNTIME_DIR"] = _RUNTIME_DIR
atexit.register(shutil.rmtree, _RUNTIME_DIR, True)

import gc  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# No cyclic collection while the test modules are imported: each full collection walks the
# growing heap (~20 of them, ~4 s of a worker's collection); collected once at its end instead.
GC_WAS_ENABLED = gc.isenabled()
gc.disable()

torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton kernels can only be interpreted here. Set before triton is first imported: its own
    # library functions (tl.sum, ...) are built interpreted or compiled at import. The
    # interpreter's tl.dot is then made as row-independent as a GPU's (see interpreter_dot).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from interpreter_calls import skip_repatching_in_device_calls
    from interpreter_dot import make_interpreter_dot_row_independent
    from interpreter_dtypes import cache_interpreter_np_dtypes
    from interpreter_types import cache_interpreter_block_types

    make_interpreter_dot_row_independent()
    skip_repatching_in_device_calls()
    cache_interpreter_np_dtypes()
    cache_interpreter_block_types()


def pytest_addoption(parser):
    parser.addoption("--multigpu-width", choices=("pair", "wide"), default=None,
                     help="keep only the multigpu tests that use at most two GPUs (pair) or more (wide): "
                          "scripts/multigpu_validation.sh runs the pairs on two GPU pairs at once")


def multigpu_width(item) -> tuple[int, int]:
    """(GPUs a multigpu test needs, GPUs it uses when the host has them): ``gpus(n, up_to=m)``,
    default (2, 2)."""
    mark = item.get_closest_marker("gpus")
    need = mark.args[0] if mark is not None and mark.args else 2
    return need, max(need, mark.kwargs.get("up_to", need) if mark is not None else need)


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    width = config.getoption("--multigpu-width")
    kept, dropped = [], []
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "multigpu" in item.keywords:
            need, uses = multigpu_width(item)
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need}+ CUDA devices (scripts/multigpu_validation.sh)"))
            if width is not None and (uses > 2) != (width == "wide"):
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _give_cuda_memory_back(request):
    """After a GPU test, the memory of engines it built in this process goes back to the device: an
    engine's KV pool takes most of a GPU, and a later test's engine processes on that GPU would
    find it taken (torch's allocator keeps what it freed unless emptied)."""
    yield
    if ("gpu" in request.keywords or "multigpu" in request.keywords) and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_finish(session):
    """Freeze what collection built (every test module, its imports, the items): it lives for
    the whole run, and a full collection (the benchmark's gc.collect() before each timed run,
    HF continuous batching's at its stop) then walks only what came after, not the ~600,000
    objects of a worker holding the suite (~0.5-1 s a call)."""
    import atexit

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit: Triton's bindings would report frozen objects as leaks
    if GC_WAS_ENABLED:
        gc.enable()


def pytest_make_parametrize_id(config, val, argname):
    """A bytes parameter over 40 bytes is named by its head and size, not its whole content: a
    test id holding a 200 KB payload is in the environment (PYTEST_CURRENT_TEST) of every process
    the test starts, over Linux's 128 KB limit for one variable (exec fails with E2BIG)."""
    if isinstance(val, bytes) and len(val) > 40:
        return f"{repr(val[:24])[2:-1]}...({len(val)} bytes)"  # escaped as pytest escapes bytes
    return None
