"""The trainer's side of an IPC update (``ipc.py`` has the payload format and the engine's side).

``share(items)`` describes every storage afresh: each CUDA storage gets a new IPC reference
counter, which the engine must release one by one (torch's bookkeeping, a few microseconds per
storage). ``Sharer`` shares each storage once and gives the same entry again while the storage
lives where it was, so the payload of a trainer that updates its parameters in place is the same
every step and the engine takes it from its cache at no cost per storage:

    sharer = ipc.Sharer()
    for step in ...:
        train_step(); torch.cuda.synchronize()          # the engine reads without waiting on an event
        engine.update_weights_from_ipc(sharer.share(megatron_tensors(model)))

A payload may name the engine rank it is for (``engine_rank``: every trainer rank shares what
lies on its own GPU, each engine rank maps only its own; ``ipc.py``) and ask the engine to unmap
its storages after the copy (``release_after``: the trainer frees or moves them next; the sharer
forgets its entries, so the following payload shares afresh).

A CUDA IPC handle names a whole allocation of the trainer's caching allocator (a segment), and
that allocator packs many tensors into one segment. The payload names each segment once
(``segments``): one entry spanning the storages shared out of it, carrying every storage's IPC
reference counter (``ref_counters``: those after the first), and each tensor's ``storage_offset``
counted from the span's start. The engine maps a segment once however many parameters it holds
(``ipc_storages.py`` holds every counter of an entry and releases each when it unmaps)."""
from __future__ import annotations

import base64
import functools
from typing import Iterable

import torch

from megatron_async.models.megatron_layouts import Shard
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS, DTYPES


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


@functools.lru_cache(maxsize=None)  # (fixed for a process: its visible devices do not change)
def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_entry(shared: tuple, uuid_of=device_uuid) -> dict:
    """The payload entry of what ``UntypedStorage._share_cuda_()`` returned (the handle names the
    storage's whole allocator segment, ``offset_bytes`` where the storage starts in it)."""
    device, handle, nbytes, offset, rc_handle, rc_offset, ev_handle, ev_sync = shared
    return {"kind": "cuda", "device_uuid": uuid_of(device), "handle": _b64(handle), "nbytes": nbytes,
            "offset_bytes": offset, "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": rc_offset,
            "event_handle": _b64(ev_handle or b""), "event_sync_required": bool(ev_sync)}


def share_storage(st: torch.UntypedStorage) -> dict:
    """One storage's payload entry (a new CUDA IPC reference each call)."""
    if st.device.type == "cuda":
        return cuda_entry(st._share_cuda_())
    if st.device.type == "cpu":
        if not st.is_shared():
            raise ValueError("CPU tensors must be in shared memory (torch.multiprocessing.set_sharing_strategy("
                             "'file_system'), then tensor.share_memory_()) before they are shared")
        manager, handle, nbytes = st._share_filename_cpu_()
        return {"kind": "cpu_shm", "manager": _b64(manager), "handle": _b64(handle), "nbytes": nbytes}
    raise ValueError(f"cannot share a {st.device.type} tensor")


def segments(entries: list[dict]) -> tuple[list[dict], list[tuple[int, int]]]:
    """``entries`` (one per storage) with the CUDA ones of one segment (GPU and IPC handle) made
    one entry spanning them all, in the order each segment first appears: (the entries, per input
    entry its (index among them, byte offset of its storage in that entry)). The first storage's
    counter and event stay the entry's own; the others' counters are its ``ref_counters``."""
    out: list[dict] = []
    members: dict[tuple, list[int]] = {}
    for i, e in enumerate(entries):
        members.setdefault((e["device_uuid"], e["handle"]) if e["kind"] == "cuda" else (i,), []).append(i)
    where: list[tuple[int, int]] = [(0, 0)] * len(entries)
    for group in members.values():
        first = entries[group[0]]
        if len(group) == 1:
            where[group[0]] = (len(out), 0)
            out.append(first)
            continue
        start = min(entries[i]["offset_bytes"] for i in group)
        end = max(entries[i]["offset_bytes"] + entries[i]["nbytes"] for i in group)
        for i in group:
            where[i] = (len(out), entries[i]["offset_bytes"] - start)
        out.append({**first, "offset_bytes": start, "nbytes": end - start, "ref_counters": [
            [entries[i]["ref_counter_handle"], entries[i]["ref_counter_offset"]] for i in group[1:]]})
    return out, where


def segment_of(entry: dict) -> tuple | None:
    """The segment a CUDA entry's storage lies in (None for shared memory)."""
    return (entry["device_uuid"], entry["handle"]) if entry["kind"] == "cuda" else None


def _payload(items: Iterable[tuple], weights_format: str, entry_of, engine_rank: int | None,
             release_after: bool, settle=None) -> dict:
    """``settle(places, storages, entries)``: the entries to use for the storages found (a sharer
    shares a segment's storages afresh when the ones it names changed)."""
    storages: list[dict] = []
    index: dict[tuple, int] = {}
    objects: list[torch.UntypedStorage] = []
    tensors = []
    for name, t, *rest in items:
        t = t.detach()
        st = t.untyped_storage()
        where = (st.device, st.data_ptr(), st.nbytes())
        if where not in index:
            index[where] = len(storages)
            storages.append(entry_of(t, st, where))
            objects.append(st)
        shard = rest[0] if rest and rest[0] is not None else Shard()
        tensors.append({"name": name, "storage": index[where], "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                        **{k: getattr(shard, k) for k in _SHARD_FIELDS}})
    if settle is not None:
        storages = settle(list(index), objects, storages)
    storages, at = segments(storages)
    for t in tensors:
        t["storage"], shift = at[t["storage"]]
        if shift:
            size = DTYPES[t["dtype"]].itemsize
            if shift % size:  # (the allocator aligns blocks to 512 bytes)
                raise ValueError(f"{t['name']}: its storage starts {shift} bytes into its segment's span, "
                                 f"not a multiple of its element size {size}")
            t["storage_offset"] += shift // size
    out = {"weights_format": weights_format, "storages": storages, "tensors": tensors}
    if engine_rank is not None:
        out["engine_rank"] = engine_rank
    if release_after:
        out["release_after"] = True
    return out


def share(items: Iterable[tuple], weights_format: str = "megatron", engine_rank: int | None = None,
          release_after: bool = False) -> dict:
    """The payload for (name, tensor[, Shard]) items (CUDA tensors, or CPU tensors in shared
    memory under the "file_system" sharing strategy), every storage shared afresh."""
    return _payload(items, weights_format, lambda t, st, where: share_storage(st), engine_rank, release_after)


class Sharer:
    """``share`` that shares each storage once and gives its entry again while a payload names
    it. It holds every storage it shared until a payload no longer names it (or ``forget``), as
    the engine's mapping holds it too, so no other tensor of the trainer can take that memory
    while the engine may read it through the old entry: a parameter given new memory is a new
    storage, shared afresh under a new key.

    A segment's entry is given again only while the payload names the same storages of it: when
    they change (one freed, one added), every storage of that segment is shared afresh, so the
    engine's new mapping of the segment holds counters of its own while it unmaps the old one."""

    def __init__(self):
        self._entries: dict[tuple, tuple[dict, torch.UntypedStorage]] = {}
        self._members: dict[tuple, list[tuple]] = {}  # segment -> the storages the last payload named of it
        self.shared = 0
        """Storages shared afresh (the others were given again)."""

    def share(self, items: Iterable[tuple], weights_format: str = "megatron", engine_rank: int | None = None,
              release_after: bool = False) -> dict:
        """The payload of ``items`` (as ``share``); ``release_after``: the engine unmaps these
        storages after its copy, and this sharer forgets them."""
        kept, named = self._entries, {}

        def entry_of(t, st, where):
            found = kept.get(where)
            if found is None:
                found = (share_storage(st), st)
                self.shared += 1
            named[where] = found
            return found[0]

        members: dict[tuple, list[tuple]] = {}

        def settle(places, objects, entries):
            for where, e in zip(places, entries):
                seg = segment_of(e)
                if seg is not None:
                    members.setdefault(seg, []).append(where)
            for seg, wheres in members.items():
                if self._members.get(seg, wheres) != wheres and any(w in kept for w in wheres):
                    for w in wheres:  # the storages named of this segment changed: new counters for all
                        if kept.get(w) is named[w]:
                            named[w] = (share_storage(named[w][1]), named[w][1])
                            self.shared += 1
            return [named[w][0] for w in places]

        out = _payload(items, weights_format, entry_of, engine_rank, release_after, settle)
        # storages no longer named: the engine unmaps them too
        self._entries, self._members = ({}, {}) if release_after else (named, members)
        return out

    def forget(self) -> None:
        """Share every storage afresh next time (the engine was told to unmap them, or restarted)."""
        self._entries, self._members = {}, {}
