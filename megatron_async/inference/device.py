"""The one place that knows CUDA from CPU: pinned memory, events, streams degrade to no-ops on CPU."""
from __future__ import annotations

import contextlib

import torch


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """Enqueue a copy of ``t`` into a new host tensor (pinned when ``t`` is on CUDA, so the copy is
    really asynchronous); read it after an event recorded later has passed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return host


class DeviceFacade:
    def __init__(self, device: torch.device | str, suspend_backend=None):
        """``suspend_backend``: a ``memory_suspend.SuspendBackend`` when the engine may suspend
        (``InferenceConfig.enable_suspend``); its regions then hold the KV and state pools."""
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.suspend_backend = suspend_backend

    def memory_region(self, tag: str):
        """Context manager: device memory allocated inside can be suspended under ``tag``."""
        return self.suspend_backend.region(tag) if self.suspend_backend is not None else contextlib.nullcontext()

    def graph_capture(self, graph, pool, capture_error_mode: str):
        """``torch.cuda.graph``, its pool suspendable with the KV cache when suspend is enabled."""
        if self.suspend_backend is not None:
            return self.suspend_backend.graph_capture(graph, pool, capture_error_mode)
        return torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer; pinned on CUDA so non-blocking copies are really asynchronous."""
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)

    def event(self, blocking: bool = False) -> "torch.cuda.Event | None":
        """``blocking``: a host wait on it sleeps until the device signals (no core burnt,
        tens of microseconds later awake) instead of spinning."""
        return torch.cuda.Event(blocking=blocking) if self.is_cuda else None

    def record(self, event) -> None:
        if event is not None:
            event.record()

    def wait_host(self, event) -> None:
        """Block the CPU until ``event`` has passed on the device (no-op on CPU)."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0
