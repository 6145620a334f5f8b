"""Weights shared by a process on the same machine (colocated trainer and engine): the trainer
shares its tensors' storages (CUDA IPC on a GPU, shared memory on CPU) and describes them in plain
JSON; the engine validates the description, maps the storages itself and copies from them into
its parameters (no host round trip, no pickle: the payload names no callable, only the fields
torch's own storage constructors take).

    {"weights_format": "megatron",
     "storages": [{"kind": "cuda", "device_uuid": "...", "handle": b64, "nbytes": int,
                   "offset_bytes": int, "ref_counter_handle": b64, "ref_counter_offset": int,
                   "event_handle": b64, "event_sync_required": bool}
                | {"kind": "cpu_shm", "manager": b64, "handle": b64, "nbytes": int}],
     "tensors": [{"name": str, "storage": int, "dtype": str, "shape": [int], "stride": [int],
                  "storage_offset": int, "tp_rank": int, "tp_size": int, ...shard fields}]}

Tensors that share a storage (Megatron-Core's contiguous parameter buffers) name it once. The GPU
is named by UUID, not index (CUDA_VISIBLE_DEVICES differs between processes). One payload per
trainer rank; the engine takes a list. The trainer keeps its tensors alive and unchanged until
the engine answered; the engine keeps the storages mapped for the next update with the same
payload (``IpcStorages.release`` drops them)."""
from __future__ import annotations

import base64
import json
import math
from itertools import chain
from operator import itemgetter, mul
from typing import Iterable, Mapping

import torch

from megatron_async.models.megatron_layouts import Shard
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS, DTYPES, FORMATS, check_int

_B64_FIELDS = {"cuda": ("handle", "ref_counter_handle", "event_handle"), "cpu_shm": ("manager", "handle")}
_TENSOR_FIELDS = frozenset({"name", "storage", "dtype", "shape", "stride", "storage_offset", *_SHARD_FIELDS})


class IpcHandleError(ValueError):
    """A malformed or out-of-bounds payload, or a storage this engine rank cannot map."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s, what: str) -> bytes:
    if not isinstance(s, str):
        raise IpcHandleError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise IpcHandleError(f"{what} is not valid base64: {e}") from None


def _int(x, what: str, optional: bool = False) -> int | None:
    return check_int(x, what, optional, IpcHandleError)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


# ---------------------------------------------------------------------------- trainer side
def share(items: Iterable[tuple], weights_format: str = "megatron") -> dict:
    """The payload for (name, tensor[, Shard]) items (CUDA tensors, or CPU tensors in shared
    memory under the "file_system" sharing strategy)."""
    storages: list[dict] = []
    index: dict[int, int] = {}
    tensors = []
    for name, t, *rest in items:
        t = t.detach()
        st = t.untyped_storage()
        if st.data_ptr() not in index:
            index[st.data_ptr()] = len(storages)
            storages.append(_share_storage(st))
        shard = rest[0] if rest and rest[0] is not None else Shard()
        tensors.append({"name": name, "storage": index[st.data_ptr()], "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                        **{k: getattr(shard, k) for k in _SHARD_FIELDS}})
    return {"weights_format": weights_format, "storages": storages, "tensors": tensors}


def _share_storage(st: torch.UntypedStorage) -> dict:
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


# ---------------------------------------------------------------------------- engine side
def _check_storage(s) -> None:
    if not isinstance(s, Mapping) or s.get("kind") not in _B64_FIELDS:
        raise IpcHandleError(f"a storage must be a {{'kind': 'cuda' | 'cpu_shm', ...}} object, got {s!r:.200}")
    _int(s.get("nbytes"), "storage nbytes")
    for f in _B64_FIELDS[s["kind"]]:
        _unb64(s.get(f), f"storage {f}")
    if s["kind"] == "cuda":
        if not isinstance(s.get("device_uuid"), str):
            raise IpcHandleError("a CUDA storage needs its device_uuid")
        _int(s.get("offset_bytes"), "offset_bytes")
        _int(s.get("ref_counter_offset"), "ref_counter_offset")


def _natural(x) -> bool:
    return type(x) is int and x >= 0


_VALID_SHARDS: set[tuple] = set()
"""Shard fields already checked (a payload repeats a few shards in every tensor)."""
_ABSENT = object()
_SHARD_TYPES = frozenset({int, type(None), object})
"""Types a shard tuple of a tensor entry may hold before it is looked up (a bool equals an int)."""


def _check_tensor(t, storages: list, first: int) -> dict:
    """``t`` checked, its storage numbered from ``first`` (error texts are built only for a field
    that fails: a payload has thousands)."""
    if not (type(t) is dict or isinstance(t, Mapping)) or not isinstance(t.get("name"), str):
        raise IpcHandleError(f"a tensor entry needs a string 'name', got {t!r:.200}")
    name = t["name"]
    if not _TENSOR_FIELDS.issuperset(t):
        raise IpcHandleError(f"{name}: unknown fields {sorted(set(t) - _TENSOR_FIELDS)}")
    if t.get("dtype") not in DTYPES:
        raise IpcHandleError(f"{name}: dtype must be one of {sorted(DTYPES)}, got {t.get('dtype')!r}")
    sid = t.get("storage")
    if not _natural(sid):
        sid = _int(sid, f"{name}: storage")
    if sid >= len(storages):
        raise IpcHandleError(f"{name}: storage {sid} does not exist")
    shape, stride = t.get("shape"), t.get("stride")
    if not isinstance(shape, list) or not isinstance(stride, list):
        raise IpcHandleError(f"{name}: shape and stride must be lists")
    if not all(map(_natural, shape)):
        shape = [_int(x, f"{name}: shape") for x in shape]
    if not all(map(_natural, stride)):
        stride = [_int(x, f"{name}: stride") for x in stride]
    if len(shape) != len(stride):
        raise IpcHandleError(f"{name}: shape and stride differ in length")
    offset = t.get("storage_offset")
    if not _natural(offset):
        offset = _int(offset, f"{name}: storage_offset")
    end = offset + sum(map(mul, shape, stride)) - sum(stride) + 1 if math.prod(shape) else offset  # + sum((n - 1) * s)
    if end * DTYPES[t["dtype"]].itemsize > storages[sid]["nbytes"]:
        raise IpcHandleError(f"{name}: reaches beyond its storage")
    shard = tuple(map(t.get, _SHARD_FIELDS, (_ABSENT,) * len(_SHARD_FIELDS)))
    if not (set(map(type, shard)) <= _SHARD_TYPES and shard in _VALID_SHARDS):
        fields = {k: _int(v, f"{name}: {k}", k.startswith("etp")) for k, v in zip(_SHARD_FIELDS, shard) if v is not _ABSENT}
        try:
            Shard(**fields)
        except ValueError as e:
            raise IpcHandleError(f"{name}: {e}") from None
        if len(_VALID_SHARDS) < 4096:
            _VALID_SHARDS.add(shard)
    return {**t, "shape": list(shape), "stride": list(stride), "storage": first + sid}  # lists of its own


def _payloads(handles) -> list[Mapping]:
    """The payloads of ``handles`` (a payload, a list, or either as JSON), each an object with
    ``storages`` and ``tensors`` lists and a known ``weights_format``; one format for all."""
    try:
        payloads = json.loads(handles) if isinstance(handles, (str, bytes)) else handles
    except json.JSONDecodeError as e:
        raise IpcHandleError(f"handles are not valid JSON: {e}") from None
    payloads = [payloads] if isinstance(payloads, Mapping) else payloads
    if not isinstance(payloads, list) or not payloads:
        raise IpcHandleError("handles must be a payload object or a non-empty list of them")
    out = []
    for p in payloads:
        try:
            p = json.loads(p) if isinstance(p, (str, bytes)) else p
        except json.JSONDecodeError as e:
            raise IpcHandleError(f"a payload is not valid JSON: {e}") from None
        if not isinstance(p, Mapping) or not isinstance(p.get("storages"), list) or not isinstance(p.get("tensors"), list):
            raise IpcHandleError("a payload is an object with 'storages' and 'tensors' lists")
        if p.get("weights_format", "megatron") not in FORMATS:
            raise IpcHandleError(f"weights_format must be one of {FORMATS}, got {p.get('weights_format')!r}")
        out.append(p)
    if len({p.get("weights_format", "megatron") for p in out}) != 1:
        raise IpcHandleError("payloads of one update must share one weights_format")
    return out


def _tensors(payloads: list[Mapping]) -> list[dict]:
    """Every payload's tensors checked (its storages checked before), storages numbered across them."""
    tensors, first = [], 0
    for p in payloads:
        tensors += [_check_tensor(t, p["storages"], first) for t in p["tensors"]]
        first += len(p["storages"])
    return tensors


def parse(handles) -> tuple[str, list[dict], list[dict]]:
    """Validate one payload or a list of them without opening anything: (weights_format,
    storages, tensors) with every tensor's ``storage`` made an index into the joined list."""
    payloads, storages, fmt = _checked_storages(handles)
    return fmt, storages, _tensors(payloads)


def _checked_storages(handles) -> tuple[list[Mapping], list[dict], str]:
    """(the payloads, their storages checked and joined, the weights_format)."""
    payloads = _payloads(handles)
    storages = [s for p in payloads for s in p["storages"]]
    for s in storages:
        _check_storage(s)
    return payloads, storages, payloads[0].get("weights_format", "megatron")


def storage_key(s: Mapping) -> str:
    """Which memory a storage entry names (not the per-share reference counter / event fields,
    which change each time the trainer shares the same storage)."""
    if s["kind"] == "cuda":
        return f"cuda:{s['device_uuid']}:{s['handle']}:{s['offset_bytes']}:{s['nbytes']}"
    return f"cpu_shm:{s['manager']}:{s['handle']}:{s['nbytes']}"


def tensors_key(tensors: list[dict]) -> tuple:
    """Each checked tensor's name, place in its storage and shard."""
    return tuple((t["name"], t["storage"], t["dtype"], tuple(t["shape"]), tuple(t["stride"]),
                  t["storage_offset"], *(t.get(k) for k in _SHARD_FIELDS)) for t in tensors)


def plan_key(weights_format: str, storages: list[dict], tensors: list[dict], tensor_part: tuple | None = None) -> tuple:
    """What an update's copy plan depends on (``parse``'s output): which storages, and each
    tensor's name, place in them and shard (``tensor_part``: ``tensors_key(tensors)`` kept)."""
    return ("ipc", weights_format, tuple(storage_key(s) for s in storages),
            tensors_key(tensors) if tensor_part is None else tensor_part)


_ENTRY_TYPES = frozenset({str, int, list, type(None)})
"""The JSON types of a checked tensor entry's values (its lists hold ints only)."""


def _same(raw, kept: list[dict]) -> bool:
    """Whether ``raw`` tensor entries are ``kept`` ones: equal values of the same JSON types (an
    int and the equal float or bool compare equal, and the check would refuse those)."""
    return (type(raw) is list and raw == kept and set(map(type, raw)) <= {dict}
            and set(map(type, chain.from_iterable(map(dict.values, raw)))) <= _ENTRY_TYPES
            and set(map(type, chain.from_iterable(chain(map(itemgetter("shape"), raw),
                                                        map(itemgetter("stride"), raw))))) <= {int})


class CheckedPayloads:
    """``parse`` keeping its last answer. A trainer shares the same tensors every step (only its
    storages' per-share reference counter and event fields change), so when every payload's
    tensor entries are the last ones checked (``_same``: its own copy of them, kept from the
    check) and its storages have the same sizes, their check and plan key are taken as they
    were; the storages are checked each time."""

    def __init__(self):
        self._last = None  # (per payload (format, storage sizes), copies of the entries, tensors, their key)
        self.reused = 0
        """Updates whose tensor entries were taken from the last check."""

    def parse(self, handles) -> tuple[str, list[dict], list[dict], tuple]:
        """``parse(handles)`` and the update's ``plan_key``."""
        payloads, storages, fmt = _checked_storages(handles)
        sizes = [(fmt, tuple(s["nbytes"] for s in p["storages"])) for p in payloads]
        last = self._last
        if last is not None and last[0] == sizes and all(_same(p["tensors"], k) for p, k in zip(payloads, last[1])):
            self.reused += 1
            tensors, part = last[2], last[3]
        else:
            self._last = None
            tensors = _tensors(payloads)
            part = tensors_key(tensors)
            kept, at, first = [], 0, 0
            for p in payloads:  # a payload whose storages are numbered from 0 parsed to entries equal to its own
                n = len(p["tensors"])
                kept.append(tensors[at: at + n] if first == 0 else
                            [{**t, "shape": list(t["shape"]), "stride": list(t["stride"])} for t in p["tensors"]])
                at, first = at + n, first + len(p["storages"])
            self._last = (sizes, kept, tensors, part)
        return fmt, storages, tensors, plan_key(fmt, storages, tensors, part)


class IpcStorages:
    """The storages an engine rank mapped, kept for the next update that names them again."""

    def __init__(self):
        self._open: dict[str, torch.UntypedStorage] = {}

    def open(self, storages: list[dict]) -> list[torch.UntypedStorage]:
        """Every storage mapped (those of the previous update reused: the trainer's new
        reference count on them is released at once, as torch's own reductions do); storages
        no longer named are released."""
        opened: dict[str, torch.UntypedStorage] = {}
        for s in storages:
            k = storage_key(s)
            if k in opened:
                continue
            if k in self._open:
                opened[k] = self._open[k]
                if s["kind"] == "cuda":
                    torch.UntypedStorage._release_ipc_counter_cuda(_unb64(s["ref_counter_handle"], "ref_counter_handle"),
                                                                   s["ref_counter_offset"])
            else:
                opened[k] = _open_storage(s)
        self._open = opened
        return [opened[storage_key(s)] for s in storages]

    def release(self) -> None:
        self._open = {}


def _open_storage(s: Mapping) -> torch.UntypedStorage:
    if s["kind"] == "cpu_shm":
        return torch.UntypedStorage._new_shared_filename_cpu(_unb64(s["manager"], "manager"),
                                                              _unb64(s["handle"], "handle"), s["nbytes"])
    local = [i for i in range(torch.cuda.device_count()) if device_uuid(i) == s["device_uuid"]]
    if not local:
        raise IpcHandleError(f"GPU {s['device_uuid']} is not visible to this engine rank")
    return torch.UntypedStorage._new_shared_cuda(
        local[0], _unb64(s["handle"], "handle"), s["nbytes"], s["offset_bytes"],
        _unb64(s["ref_counter_handle"], "ref_counter_handle"), s["ref_counter_offset"],
        _unb64(s["event_handle"], "event_handle"), bool(s.get("event_sync_required")))


def views(storages: list[torch.UntypedStorage], tensors: list[dict]) -> list[torch.Tensor]:
    """The trainer's tensors as views of the mapped storages (no copy): one tensor over each
    storage per dtype, and each view strided out of it."""
    whole: dict[tuple[int, str], torch.Tensor] = {}
    out = []
    for t in tensors:
        key = (t["storage"], t["dtype"])
        flat = whole.get(key)
        if flat is None:
            st = storages[t["storage"]]
            flat = whole[key] = torch.empty(0, dtype=DTYPES[t["dtype"]], device=st.device).set_(st)
        out.append(flat.as_strided(t["shape"], t["stride"], t["storage_offset"]))
    return out
