"""The storages an engine rank mapped from a trainer (``ipc.py``'s payload entries), kept across
updates.

A mapping is kept under the storage's key (which memory: GPU, IPC handle, offset and size, or the
shared-memory file), so an update that names the same memory again maps nothing. A CUDA entry also
carries the IPC reference counter its ``_share_cuda_`` took in the trainer; the engine holds the
counter of the share it mapped (the trainer keeps that memory out of its allocator's reach until
the mapping is dropped), and:

- the same entry again (``ipc.Sharer``: same counter): nothing to do;
- the same memory shared afresh (``ipc.share``: a new counter): that counter is released at once,
  the mapping kept (a few microseconds per storage: torch maps the counter file each time);
- a counter this engine already released (a stale entry: its memory may have gone back to the
  trainer's allocator): refused, nothing mapped;
- memory no longer named, or every mapping when the payload says ``release_after`` or on
  ``release()``: unmapped (the trainer's counter is released with it).

An entry that spans a segment of the trainer's allocator (``sharer.segments``) carries a counter
per storage in it (its own and ``ref_counters``): the mapping holds them all, the rules above hold
for each, and on unmapping torch's deleter releases the entry's own counter while the others are
released here (after the update's copies were waited for, as every update is).

An update whose storage list equals the last one (entry for entry) takes the last mapped list as
it is: one list comparison."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping

import torch

from megatron_async.models.weight_targets import Strided
from megatron_async.weight_transfer.manifest import DTYPES
from megatron_async.weight_transfer.sharer import device_uuid

SPENT_KEPT = 1 << 16
"""How many released counters are remembered (to refuse a stale entry that names one)."""


class IpcHandleError(ValueError):
    """A malformed or out-of-bounds payload, or a storage this engine rank cannot map."""


def unb64(s, what: str) -> bytes:
    import base64

    if not isinstance(s, str):
        raise IpcHandleError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise IpcHandleError(f"{what} is not valid base64: {e}") from None


def storage_key(s: Mapping) -> str:
    """Which memory a storage entry names (not the per-share reference counter / event fields)."""
    if s["kind"] == "cuda":
        return f"cuda:{s['device_uuid']}:{s['handle']}:{s['offset_bytes']}:{s['nbytes']}"
    return f"cpu_shm:{s['manager']}:{s['handle']}:{s['nbytes']}"


def counter(s: Mapping) -> tuple | None:
    """The trainer's IPC reference counter a CUDA entry's mapping owns (None for shared memory)."""
    return (s["ref_counter_handle"], s["ref_counter_offset"]) if s["kind"] == "cuda" else None


def counters(s: Mapping) -> tuple:
    """Every IPC reference counter a CUDA entry carries, its own first (empty for shared memory)."""
    if s["kind"] != "cuda":
        return ()
    return ((s["ref_counter_handle"], s["ref_counter_offset"]),
            *((h, o) for h, o in s.get("ref_counters", ())))


def open_storage(s: Mapping, device_index: int | None = None) -> torch.UntypedStorage:
    """Map one checked entry (``device_index``: the GPU it must be on; None: any visible one)."""
    if s["kind"] == "cpu_shm":
        return torch.UntypedStorage._new_shared_filename_cpu(unb64(s["manager"], "manager"),
                                                              unb64(s["handle"], "handle"), s["nbytes"])
    indices = range(torch.cuda.device_count()) if device_index is None else [device_index]
    local = [i for i in indices if device_uuid(i) == s["device_uuid"]]
    if not local:
        where = "visible to" if device_index is None else "the GPU of"
        raise IpcHandleError(f"GPU {s['device_uuid']} is not {where} this engine rank")
    return torch.UntypedStorage._new_shared_cuda(
        local[0], unb64(s["handle"], "handle"), s["nbytes"], s["offset_bytes"],
        unb64(s["ref_counter_handle"], "ref_counter_handle"), s["ref_counter_offset"],
        unb64(s["event_handle"], "event_handle"), bool(s.get("event_sync_required")))


def release_counter(c: tuple) -> None:
    torch.UntypedStorage._release_ipc_counter_cuda(unb64(c[0], "ref_counter_handle"), c[1])


class IpcStorages:
    """The storages an engine rank mapped, kept for the next update that names them again."""

    def __init__(self, opener: Callable[[Mapping], torch.UntypedStorage] = open_storage,
                 releaser: Callable[[tuple], None] = release_counter):
        """``opener`` / ``releaser``: how an entry is mapped and a counter released (torch's)."""
        self._opener, self._releaser = opener, releaser
        self._open: dict[str, tuple[torch.UntypedStorage, tuple]] = {}  # key -> (mapping, counters held)
        self._spent: OrderedDict[tuple, None] = OrderedDict()
        self._last: tuple[list, list] | None = None  # (the last storage entries, their mapped list)
        self.opened = 0
        """Entries mapped (the others were taken from the cache)."""
        self.released = 0
        """Fresh shares of mapped memory whose counter was released at once."""

    def open(self, storages: list[dict]) -> list[torch.UntypedStorage]:
        """Every storage mapped (see the module docstring); storages no longer named are unmapped.
        ``IpcHandleError`` (nothing mapped, the kept mappings unchanged) for a stale entry."""
        last = self._last
        if last is not None and last[0] == storages:
            return last[1]
        for s in storages:  # refuse before anything is mapped or released
            cs = counters(s)
            if cs and not self._spent.keys().isdisjoint(cs):
                held = self._open.get(storage_key(s), (None, ()))[1]
                if any(c in self._spent and c not in held for c in cs):
                    raise IpcHandleError(f"storage {s['handle'][:16]}... names an IPC reference the engine already "
                                         "released (a stale entry): share it afresh (ipc.Sharer.forget())")
        opened: dict[str, tuple[torch.UntypedStorage, tuple]] = {}
        fresh: list[tuple] = []
        try:
            for s in storages:
                k = storage_key(s)
                if k in opened:
                    held = opened[k]
                else:
                    held = self._open.get(k)
                    if held is None:
                        held = (self._opener(s), counters(s))
                        self.opened += 1
                    opened[k] = held
                for c in counters(s):
                    if c not in held[1] and c not in fresh:
                        fresh.append(c)  # the same memory shared again: its new counter goes back at once
        except Exception:
            for k, held in opened.items():  # mapped here for nothing: unmap (their counters are spent)
                if k not in self._open:
                    self._drop(held)
            raise
        for c in fresh:
            self._releaser(c)
            self._spend(c)
            self.released += 1
        for k, held in self._open.items():
            if k not in opened:
                self._drop(held)
        self._open = opened
        out = [opened[storage_key(s)][0] for s in storages]
        self._last = ([dict(s) for s in storages], out)
        return out

    def _drop(self, held: tuple) -> None:
        """A mapping given up: torch releases its own counter with it, the others go back here."""
        for i, c in enumerate(held[1]):
            if i:
                self._releaser(c)
            self._spend(c)

    def _spend(self, c: tuple) -> None:
        self._spent[c] = None
        if len(self._spent) > SPENT_KEPT:
            self._spent.popitem(last=False)

    def release(self) -> None:
        """Unmap everything (each mapping's counters go back to the trainer with it)."""
        for held in self._open.values():
            self._drop(held)
        self._open, self._last = {}, None


def sources(storages: list[torch.UntypedStorage], tensors: list[dict]) -> list[Strided]:
    """The trainer's tensors as ``Strided`` sources over the mapped storages (one tensor over each
    storage per dtype; the views are made by whoever reads them, once)."""
    whole: dict[tuple[int, str], torch.Tensor] = {}
    out = []
    for t in tensors:
        key = (t["storage"], t["dtype"])
        flat = whole.get(key)
        if flat is None:
            st = storages[t["storage"]]
            flat = whole[key] = torch.empty(0, dtype=DTYPES[t["dtype"]], device=st.device).set_(st)
        out.append(Strided(flat, t["shape"], t["stride"], t["storage_offset"]))
    return out


def views(storages: list[torch.UntypedStorage], tensors: list[dict]) -> list[torch.Tensor]:
    """The trainer's tensors as views of the mapped storages (no copy)."""
    return [s.tensor() for s in sources(storages, tensors)]
