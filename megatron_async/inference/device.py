"""The one place that knows CUDA from CPU: pinned memory, events, streams degrade to no-ops on CPU."""
from __future__ import annotations

import contextlib

import torch

# The bindings under torch.cuda.current_stream / set_stream, which add ~6-15 us of Python a
# call on an H100 host in a loop and 25-37 us inside an engine step (caches cold between
# steps): the per-step launch path reads and sets streams through these instead.
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_streams: dict[tuple, torch.cuda.Stream] = {}


def current_stream(device_index: int) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device_index)``: the same stream, its Python object kept."""
    if _get_stream is None:
        return torch.cuda.current_stream(device_index)
    key = _get_stream(device_index)  # (stream id, device index, device type)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= 64:  # streams a caller made and dropped
            _streams.clear()
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def set_stream(stream: "torch.cuda.Stream") -> None:
    """``torch.cuda.set_stream(stream)`` (the thread's current stream on its device)."""
    if _set_stream is None:
        torch.cuda.set_stream(stream)
    else:
        _set_stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


EVENT_RING = 8
"""Launch events ``DeviceFacade.event`` hands out in turn, per kind (blocking or spinning)."""


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
        self._index = None  # the CUDA device's index, once asked
        self._events: dict[bool, list] = {False: [], True: []}  # a ring per kind (``event``)
        self._next_event = {False: 0, True: 0}
        self.while_waiting = None
        """``while_waiting(passed)``, when set: run by ``wait_host`` while a launch's event has not
        passed (``passed()`` says when it has); it may return earlier (the wait then sleeps on
        the event). A prefill engine starts KV sends there (disaggregation/mid_step.py)."""

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
        """The next event of a ring of ``EVENT_RING`` (a new ``torch.cuda.Event`` creates its CUDA
        event at its first record and destroys it when collected: two driver calls a launch).
        An event comes back ``EVENT_RING`` calls later, when the launch that held it has long
        landed (launches land in order, at most two in flight); a wait on an event recorded
        again waits for later work of the same stream. ``blocking``: a host wait on it sleeps
        until the device signals (no core burnt, tens of microseconds later awake) instead of
        spinning."""
        if not self.is_cuda:
            return None
        ring, i = self._events[blocking], self._next_event[blocking]
        if i == len(ring) < EVENT_RING:
            ring.append(torch.cuda.Event(blocking=blocking))
        self._next_event[blocking] = (i + 1) % EVENT_RING
        return ring[i]

    def record(self, event) -> None:
        """Record ``event`` on the current stream."""
        if event is not None:
            if self._index is None:
                self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            event.record(current_stream(self._index))

    def wait_host(self, event) -> None:
        """Block the CPU until ``event`` has passed on the device (no-op on CPU)."""
        if event is not None:
            if self.while_waiting is not None and not event.query():
                self.while_waiting(event.query)
            event.synchronize()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0
