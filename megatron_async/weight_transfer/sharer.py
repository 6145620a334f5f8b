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
forgets its entries, so the following payload shares afresh)."""
from __future__ import annotations

import base64
from typing import Iterable

import torch

from megatron_async.models.megatron_layouts import Shard
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share_storage(st: torch.UntypedStorage) -> dict:
    """One storage's payload entry (a new CUDA IPC reference each call)."""
    if st.device.type == "cuda":
        device, handle, nbytes, offset, rc_handle, rc_offset, ev_handle, ev_sync = st._share_cuda_()
        return {"kind": "cuda", "device_uuid": device_uuid(device), "handle": _b64(handle), "nbytes": nbytes,
                "offset_bytes": offset, "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": rc_offset,
                "event_handle": _b64(ev_handle or b""), "event_sync_required": bool(ev_sync)}
    if st.device.type == "cpu":
        if not st.is_shared():
            raise ValueError("CPU tensors must be in shared memory (torch.multiprocessing.set_sharing_strategy("
                             "'file_system'), then tensor.share_memory_()) before they are shared")
        manager, handle, nbytes = st._share_filename_cpu_()
        return {"kind": "cpu_shm", "manager": _b64(manager), "handle": _b64(handle), "nbytes": nbytes}
    raise ValueError(f"cannot share a {st.device.type} tensor")


def _payload(items: Iterable[tuple], weights_format: str, entry_of, engine_rank: int | None,
             release_after: bool) -> dict:
    storages: list[dict] = []
    index: dict[tuple, int] = {}
    tensors = []
    for name, t, *rest in items:
        t = t.detach()
        st = t.untyped_storage()
        where = (st.device, st.data_ptr(), st.nbytes())
        if where not in index:
            index[where] = len(storages)
            storages.append(entry_of(t, st, where))
        shard = rest[0] if rest and rest[0] is not None else Shard()
        tensors.append({"name": name, "storage": index[where], "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                        **{k: getattr(shard, k) for k in _SHARD_FIELDS}})
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
    storage, shared afresh under a new key."""

    def __init__(self):
        self._entries: dict[tuple, tuple[dict, torch.UntypedStorage]] = {}
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

        out = _payload(items, weights_format, entry_of, engine_rank, release_after)
        self._entries = {} if release_after else named  # storages no longer named: the engine unmaps them too
        return out

    def forget(self) -> None:
        """Share every storage afresh next time (the engine was told to unmap them, or restarted)."""
        self._entries = {}
