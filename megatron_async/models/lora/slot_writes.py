"""Writing a staged adapter into a slot between two steps without the host ever waiting for the
device, and freeing a slot without touching it.

Freeing (``free``) is bookkeeping only: no request names a free slot, so no forward reads it, and
the next install overwrites every linear's part of it (the touched ones from the staged image,
zero-padded to ``max_lora_rank``; the others zeroed). On CUDA it records where the compute stream
stood (an event: a launch in flight may still have read the slot).

An install into a free slot (``install(..., in_use=False)``) runs on a copy stream of its own: it
waits only for that event, not for the steps in flight, so the pinned image's host-to-device copies
overlap them; the compute stream then waits for the copies' event (``cudaStreamWaitEvent``: the host
goes on). An install into a slot in use (``update_lora``) stays on the compute stream, ordered after
the launches that read the old weights. An image staged on the device (a refit's) is copied on the
compute stream too (it was written there). The copies are ``cudaMemcpyAsync`` (no kernel: nothing
for lazy module loading to load mid-serving), the zeroing of untouched linears one multi-tensor
kernel, run once when the writer is built (``prime``) so its module is loaded before any step."""
from __future__ import annotations

import contextlib

import torch


def unique_slots(targets: dict) -> dict[int, object]:
    """Every distinct ``LoRASlots`` / ``ExpertLoRASlots`` of ``targets``, keyed by ``id``."""
    return {id(t.slots): t.slots for t in targets.values()}


@torch.no_grad()
def zero_slot(all_slots: list, slot: int) -> None:
    """Zero slot ``slot`` of every linear in ``all_slots`` with one multi-tensor op per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for slots in all_slots:
        for t in slots.slot_views(slot):
            by_dtype.setdefault(t.dtype, []).append(t)
    for tensors in by_dtype.values():
        torch._foreach_zero_(tensors)


class SlotWriter:
    def __init__(self, targets: dict, max_loras: int):
        self.slots = unique_slots(targets)
        first = next(iter(self.slots.values()))
        self.device = first.a.device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._freed_at: dict[int, object] = {}
        """Slot -> event on the compute stream where it was freed (CUDA)."""
        self._views = [{key: s.slot_views(slot) for key, s in self.slots.items()} for slot in range(max_loras)]
        """Each slot's (a, b, scale) views of every linear, made once (the install's destinations)."""
        self.prime()

    @torch.no_grad()
    def prime(self) -> None:
        """Run the install's device ops once on slot 0 (zeros onto zeros, before any adapter):
        their kernels' modules load now, not in the middle of serving, where a lazily loaded
        module waits for the work in flight."""
        zero_slot(list(self.slots.values()), 0)
        views = list(self._views[0].values())
        for i in range(3):  # a, b (model dtype), scale (float32): the device-staged copies' fast path
            torch._foreach_copy_([v[i] for v in views], [v[i] for v in views])

    def free(self, slot: int) -> None:
        """Slot ``slot`` holds no adapter from now on (nothing is written)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._freed_at[slot] = event

    @torch.no_grad()
    def install(self, staged, slot: int, in_use: bool, lap) -> None:
        """Copy ``staged`` (staging.StagedAdapter) into slot ``slot`` of every linear, zeros where
        it has nothing; ``in_use``: requests may read the slot (ordered after them). ``lap(name)``
        ends a timed phase."""
        views = self._views[slot]
        dst_ab, dst_scale = [], []
        for key in staged.keys:
            a, b, sc = views[key]
            dst_ab += (a, b)
            dst_scale.append(sc)
        untouched = [s for key, s in self.slots.items() if key not in staged.key_set]
        side = self.cuda and not in_use and staged.flat.device.type == "cpu"
        with self._ordered(slot) if side else contextlib.nullcontext():
            lap("order")
            if dst_ab:
                torch._foreach_copy_(dst_ab, staged.src_ab, non_blocking=True)
                torch._foreach_copy_(dst_scale, staged.src_scale, non_blocking=True)
            lap("copy")
            if untouched:
                zero_slot(untouched, slot)
            lap("zero")

    @contextlib.contextmanager
    def _ordered(self, slot: int):
        """The copy stream as the current stream, after the slot was freed; the compute stream
        waits for what it issued."""
        compute = torch.cuda.current_stream(self.device)
        freed = self._freed_at.pop(slot, None)
        if freed is not None:
            self.copy_stream.wait_event(freed)
        with torch.cuda.stream(self.copy_stream):
            yield
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        compute.wait_event(done)
