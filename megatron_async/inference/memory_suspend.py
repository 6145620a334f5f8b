"""Device memory released and restored by tag, keeping every tensor's address (engine.suspend).

Two backends behind one small interface:
- ``TorchMemorySaverBackend`` (CUDA): the ``torch-memory-saver`` package. Tensors allocated inside
  ``region(tag)`` live on CUDA virtual memory; ``release(tag)`` unmaps their physical pages and
  ``restore(tag)`` maps fresh ones at the same addresses, so captured CUDA graphs stay valid.
  Graph pools are tagged by capturing through ``graph_capture``; that needs the process started
  with the package's library in ``LD_PRELOAD`` (``preload_library()``), otherwise graph pools stay
  resident and only tensors are released.
- ``EmulatedBackend`` (CPU): frees the storages of the given tensors (``resize_(0)``) and
  reallocates them, the same Python tensors, so CPU tests run the engine's whole suspend logic.

Restored memory holds garbage: what must survive (weights, running requests' KV) is copied to
host memory before ``release`` and back after ``restore`` by the caller (engines/suspend.py)."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import sys
from collections.abc import Iterable

import torch

log = logging.getLogger("megatron_async")

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
PIP_PACKAGE = "torch-memory-saver"


class SuspendBackend:
    """Where tagged device memory comes from, and how it is released and restored."""

    def region(self, tag: str):
        """Context manager: tensors allocated inside belong to ``tag``."""
        return contextlib.nullcontext()

    def graph_capture(self, graph, pool, capture_error_mode: str, tag: str = KV_CACHE):
        """Context manager replacing ``torch.cuda.graph``: the graph's pool memory belongs to ``tag``."""
        return torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode)

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Free the device memory of ``tag`` (``tensors``: those the caller knows belong to it)."""
        raise NotImplementedError

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Give ``tag`` its memory back at the same addresses (contents undefined)."""
        raise NotImplementedError


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else id(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


class EmulatedBackend(SuspendBackend):
    """Frees and reallocates tensor storages in place (any device; used on CPU)."""

    def __init__(self):
        self._sizes: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        storages = _unique_storages(tensors)
        self._sizes[tag] = [(s, s.nbytes()) for s in storages]
        for s in storages:
            s.resize_(0)

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        for s, nbytes in self._sizes.pop(tag, []):
            s.resize_(nbytes)


def preload_library() -> str:
    """Path of torch-memory-saver's preload library: start a process with it in ``LD_PRELOAD`` so
    CUDA graph pools are released too."""
    from torch_memory_saver.utils import get_binary_path_from_package

    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def _cudart_dir() -> str | None:
    """The folder of the CUDA runtime torch loaded (pip wheels keep it in site-packages, off the
    loader's path, and the preload library needs it before torch loads it)."""
    torch.cuda.is_available()  # loads the runtime
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libcudart.so" in path:
                    return os.path.dirname(path)
    except OSError:
        pass
    for root in sys.path:  # not loaded (yet): the nvidia-cuda-runtime wheel's folder
        found = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so.*")))
        if found:
            return os.path.dirname(found[-1])
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child process whose CUDA graph pools can be
    suspended: the preload library in ``LD_PRELOAD`` and the CUDA runtime's folder in
    ``LD_LIBRARY_PATH``. ``python -m megatron_async.inference.memory_suspend`` prints them as
    shell exports."""
    env = dict(os.environ if env is None else env)
    if "torch_memory_saver" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [preload_library(), env.get("LD_PRELOAD")]))
    cudart = _cudart_dir()
    if cudart:
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [cudart, env.get("LD_LIBRARY_PATH")]))
    return env


class TorchMemorySaverBackend(SuspendBackend):
    """CUDA virtual memory through torch-memory-saver (its process-wide singleton)."""

    def __init__(self):
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as e:
            raise ImportError(f"InferenceConfig.enable_suspend on CUDA needs the {PIP_PACKAGE} package: "
                              f"pip install {PIP_PACKAGE}") from e
        self.preload = "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")
        if getattr(torch_memory_saver, "_impl", None) is None:  # mode is fixed by the first use
            torch_memory_saver.hook_mode = "preload" if self.preload else "torch"
        self._tms = torch_memory_saver
        if not self.preload:
            _allow_pool_frees_anywhere(torch_memory_saver)
        self._warned = False

    def region(self, tag: str):
        return self._tms.region(tag=tag)

    def graph_capture(self, graph, pool, capture_error_mode: str, tag: str = KV_CACHE):
        if self.preload:
            return self._tms.cuda_graph(graph, pool=pool, capture_error_mode=capture_error_mode, tag=tag)
        if not self._warned:
            self._warned = True
            log.warning("suspend: CUDA graph pools stay resident; to release them too, start the process with "
                        "the exports `python -m megatron_async.inference.memory_suspend` prints")
        return super().graph_capture(graph, pool, capture_error_mode, tag)

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        torch.cuda.synchronize()
        self._tms.pause(tag)
        torch.cuda.empty_cache()  # the untagged allocator cache (eager steps' activations) goes too

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        self._tms.resume(tag)
        torch.cuda.synchronize()


def _allow_pool_frees_anywhere(tms) -> None:
    """In the allocator ("torch") mode the package's free hook exits the process (status 1) when
    a thread frees pool memory outside a ``region``: the pools are destroyed at interpreter exit,
    and the caching allocator may release a pool's blocks from any thread. Its region flag only
    routes allocations in the preload mode; here allocations reach the package only through a
    region's pool, so the flag can stay set everywhere: for threads yet to start (the library reads
    TMS_INIT_ENABLE on a thread's first use) and for this one, which may have read it already."""
    os.environ["TMS_INIT_ENABLE"] = "1"
    tms._ensure_initialized()
    tms._impl._binary_wrapper.cdll.tms_set_interesting_region(True)


def make_suspend_backend(device: torch.device) -> SuspendBackend:
    """The backend for ``device``: torch-memory-saver on CUDA (a clear error without it), else emulated."""
    return TorchMemorySaverBackend() if device.type == "cuda" else EmulatedBackend()


if __name__ == "__main__":
    child = preload_env()
    for key in ("LD_PRELOAD", "LD_LIBRARY_PATH"):
        if key in child:
            print(f"export {key}={child[key]}")
