"""Weights shared by a process on the same machine (colocated trainer and engine): the trainer
shares its tensors' storages (CUDA IPC on a GPU, shared memory on CPU) and describes them in plain
JSON; the engine validates the description, maps the storages itself and copies from them into
its parameters (no host round trip, no pickle: the payload names no callable, only the fields
torch's own storage constructors take).

    {"weights_format": "megatron",
     "storages": [{"kind": "cuda", "device_uuid": "...", "handle": b64, "nbytes": int,
                   "offset_bytes": int, "ref_counter_handle": b64, "ref_counter_offset": int,
                   "event_handle": b64, "event_sync_required": bool,
                   "ref_counters": [[b64, int], ...]}
                | {"kind": "cpu_shm", "manager": b64, "handle": b64, "nbytes": int}],
     "tensors": [{"name": str, "storage": int, "dtype": str, "shape": [int], "stride": [int],
                  "storage_offset": int, "tp_rank": int, "tp_size": int, ...shard fields}]}

Optional payload fields: ``"engine_rank": int`` (the engine rank this payload is for: each rank
takes only its own, ``per_rank.py``) and ``"release_after": true`` (unmap after this update).

Tensors that share a storage (Megatron-Core's contiguous parameter buffers) name it once; a CUDA
entry may span several storages of one allocator segment (``sharer.segments``: the optional
``ref_counters`` are the other storages' IPC reference counters), so each segment is mapped once. The GPU
is named by UUID, not index (CUDA_VISIBLE_DEVICES differs between processes). One payload per
trainer rank; the engine takes a list. The trainer keeps its tensors alive and unchanged until
the engine answered; the engine keeps the storages mapped for the next update with the same
payload (``ipc_storages.py``; ``IpcStorages.release`` drops them). The trainer's side is
``sharer.py`` (``share``, and ``Sharer``, whose payload is the same every step)."""
from __future__ import annotations

import json
import marshal
import math
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter, mul
from typing import Mapping

from megatron_async.models.megatron_layouts import Shard
from megatron_async.weight_transfer.ipc_storages import IpcHandleError, IpcStorages, sources, storage_key, unb64, views
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS, DTYPES, FORMATS, check_int
from megatron_async.weight_transfer.per_rank import addressed
from megatron_async.weight_transfer.sharer import Sharer, device_uuid, share

__all__ = ["CheckedPayloads", "IpcUpdate", "IpcHandleError", "IpcStorages", "Sharer", "device_uuid", "parse", "plan_key",
           "share", "sources", "storage_key", "views"]

_B64_FIELDS = {"cuda": ("handle", "ref_counter_handle", "event_handle"), "cpu_shm": ("manager", "handle")}
_TENSOR_FIELDS = frozenset({"name", "storage", "dtype", "shape", "stride", "storage_offset", *_SHARD_FIELDS})


def _unb64(s, what: str) -> bytes:
    return unb64(s, what)


def _int(x, what: str, optional: bool = False) -> int | None:
    return check_int(x, what, optional, IpcHandleError)


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
        extra = s.get("ref_counters", [])
        if not isinstance(extra, list):
            raise IpcHandleError("ref_counters must be a list of [ref_counter_handle, ref_counter_offset] pairs")
        for c in extra:
            if not isinstance(c, list) or len(c) != 2:
                raise IpcHandleError(f"a ref_counters item must be [handle, offset], got {c!r:.100}")
            _unb64(c[0], "ref_counters handle")
            _int(c[1], "ref_counters offset")


def _natural(x) -> bool:
    return type(x) is int and x >= 0


_VALID_SHARDS: set[tuple] = set()
"""Shard fields already checked (a payload repeats a few shards in every tensor)."""
_ABSENT = object()
_ABSENTS = (_ABSENT,) * len(_SHARD_FIELDS)
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
    shard = tuple(map(t.get, _SHARD_FIELDS, _ABSENTS))
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
        if type(p.get("release_after", False)) is not bool:
            raise IpcHandleError(f"release_after must be true or false, got {p.get('release_after')!r}")
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


def tensors_key(tensors: list[dict]) -> tuple:
    """Each checked tensor's name, place in its storage and shard."""
    fields = _SHARD_FIELDS
    return tuple((t["name"], t["storage"], t["dtype"], tuple(t["shape"]), tuple(t["stride"]),
                  t["storage_offset"], *map(t.get, fields)) for t in tensors)


def plan_key(weights_format: str, storages: list[dict], tensors: list[dict], tensor_part: tuple | None = None,
             per_rank: bool = False) -> tuple:
    """What an update's copy plan depends on (``parse``'s output): which storages, and each
    tensor's name, place in them and shard (``tensor_part``: ``tensors_key(tensors)`` kept), and
    whether the payloads were addressed per engine rank (``per_rank.py``)."""
    return _key(weights_format, tuple(storage_key(s) for s in storages),
                tensors_key(tensors) if tensor_part is None else tensor_part, per_rank)


def _key(weights_format: str, storage_part: tuple, tensor_part: tuple, per_rank: bool) -> tuple:
    return ("ipc", weights_format, storage_part, tensor_part) + (("per_rank",) if per_rank else ())


_ENTRY_TYPES = frozenset({str, int, list, type(None)})
"""The JSON types of a checked tensor entry's values (its lists hold ints only)."""


def _same(raw, kept: list[dict]) -> bool:
    """Whether ``raw`` tensor entries are ``kept`` ones: equal values of the same JSON types (an
    int and the equal float or bool compare equal, and the check would refuse those)."""
    return (type(raw) is list and raw == kept and set(map(type, raw)) <= {dict}
            and set(map(type, chain.from_iterable(map(dict.values, raw)))) <= _ENTRY_TYPES
            and set(map(type, chain.from_iterable(chain(map(itemgetter("shape"), raw),
                                                        map(itemgetter("stride"), raw))))) <= {int})


def _marks(payloads: list[Mapping]) -> tuple[bytes, ...] | None:
    """Each payload's tensor entries as ``marshal`` bytes, or None where marshal refuses a value.
    Equal bytes unmarshal to equal values of the same exact types (1, 1.0 and True differ), so
    entries whose bytes are those of entries checked before pass the same check: a third of
    ``_same``'s time, which compares every value and then every value's type."""
    try:
        return tuple(marshal.dumps(p["tensors"]) for p in payloads)
    except ValueError:  # a type marshal does not write (a subclass, a Mapping): compared by ``_same``
        return None


@dataclass(frozen=True)
class IpcUpdate:
    """One engine rank's checked part of an IPC update."""
    weights_format: str
    storages: list[dict]
    tensors: list[dict]
    """Checked entries, ``storage`` an index into ``storages``."""
    key: tuple
    """``plan_key``: what the copy plan depends on."""
    per_rank: bool = False
    """The payloads were addressed to this engine rank (``per_rank.addressed``)."""
    release_after: bool = False
    """Unmap the storages after the copy (a payload asked for it)."""


class CheckedPayloads:
    """``parse`` keeping its last answer. A trainer shares the same tensors every step: with
    ``Sharer`` the very same payload (the JSON text, or storage entries equal to the last ones
    checked: their checked copies are taken), with ``share`` the same tensor entries over storages whose
    per-share reference counter and event fields changed (checked again). When every payload's
    tensor entries are the last ones checked (``_same``: its own copy of them, kept from the
    check) and its storages have the same sizes, their check and plan key are taken as they were."""

    def __init__(self):
        self._last = None  # (per payload (format, storage sizes), copies of the entries, tensors, their key, _marks)
        self._storages = None  # (copies of the last checked storage entries, their keys)
        self._text = None  # (the last JSON text, engine rank, device, its IpcUpdate)
        self._keyed = None  # (format, storage part, tensor part, per_rank, their key)
        self.reused = 0
        """Updates whose tensor entries were taken from the last check."""
        self.unchanged = 0
        """Updates whose JSON text or storage entries were the last ones (nothing checked again)."""

    def parse(self, handles) -> tuple[str, list[dict], list[dict], tuple]:
        """``parse(handles)`` and the update's ``plan_key`` (every payload, for every rank)."""
        u = self.checked(handles)
        return u.weights_format, u.storages, u.tensors, u.key

    def checked(self, handles, engine_rank: int = 0, device_uuid: str | None = None) -> IpcUpdate:
        """Engine rank ``engine_rank``'s part of ``handles`` checked (``device_uuid``: its GPU)."""
        text = self._text
        if isinstance(handles, (str, bytes)) and text is not None and text[:3] == (handles, engine_rank, device_uuid):
            self.unchanged += 1
            return text[3]
        payloads, per_rank = addressed(_payloads(handles), engine_rank, device_uuid)
        fmt = payloads[0].get("weights_format", "megatron")
        storages = [s for p in payloads for s in p["storages"]]
        kept = self._storages
        if kept is not None and storages == kept[0]:  # (its checked copies are used: an equal value is the same)
            self.unchanged += 1
            storages, storage_part = kept[0], kept[1]
        else:
            self._storages = None
            for s in storages:
                _check_storage(s)
            storage_part = tuple(storage_key(s) for s in storages)
            self._storages = ([dict(s) for s in storages], storage_part)
        tensors, tensor_part = self._checked_tensors(payloads, fmt)
        u = IpcUpdate(fmt, storages, tensors, self._key(fmt, storage_part, tensor_part, per_rank), per_rank,
                      any(p.get("release_after", False) for p in payloads))
        self._text = (handles, engine_rank, device_uuid, u) if isinstance(handles, (str, bytes)) else None
        return u

    def _key(self, fmt: str, storage_part: tuple, tensor_part: tuple, per_rank: bool) -> tuple:
        """``_key`` of these parts: the last key object again when its parts are the same objects
        (a tuple does not keep its hash: the plan cache finds that key by identity, not by hashing
        every tensor's entry again)."""
        k = self._keyed
        if k is not None and k[0] == fmt and k[1] is storage_part and k[2] is tensor_part and k[3] == per_rank:
            return k[4]
        key = _key(fmt, storage_part, tensor_part, per_rank)
        self._keyed = (fmt, storage_part, tensor_part, per_rank, key)
        return key

    def _checked_tensors(self, payloads: list[Mapping], fmt: str) -> tuple[list[dict], tuple]:
        sizes = [(fmt, tuple(s["nbytes"] for s in p["storages"])) for p in payloads]
        last, marks = self._last, _marks(payloads)
        if last is not None and last[0] == sizes and (
                marks is not None and marks == last[4] or all(_same(p["tensors"], k) for p, k in zip(payloads, last[1]))):
            self.reused += 1
            self._last = (*last[:4], marks)
            return last[2], last[3]
        self._last = None
        tensors = _tensors(payloads)
        part = tensors_key(tensors)
        kept, at, first = [], 0, 0
        for p in payloads:  # a payload whose storages are numbered from 0 parsed to entries equal to its own
            n = len(p["tensors"])
            kept.append(tensors[at: at + n] if first == 0 else
                        [{**t, "shape": list(t["shape"]), "stride": list(t["stride"])} for t in p["tensors"]])
            at, first = at + n, first + len(p["storages"])
        self._last = (sizes, kept, tensors, part, marks)
        return tensors, part
