"""The one wire format of every megatron_async socket: a message is one msgpack array
``[type, field, ...]`` in one ZMQ frame, ``type`` an int from one registry of message types.

    from megatron_async.inference.communication import wire

    SUBMIT = wire.message_type("submit", 32, arity=5, reader=read_submit)   # once, at import
    frame = wire.encode(SUBMIT, rid, prompt, params, n, stream)              # -> bytes
    mtype, fields = wire.decode(frame, max_bytes=1 << 20)                    # -> WireError or ...
    record = mtype.read(fields)                                              # typed, checked

Registry: ``message_type(name, value, arity, reader)`` registers a type; values and names are
unique across the process (a second registration of either raises), never reused, and grouped
by concern (``RANGES``): the handshake's types are here, the ranks' collectives in
zmq_communicator.py, the control plane's (coordinator, engines, clients) and the server's
front-ends in theirs. ``arity`` (fields after the type, an int or a tuple of allowed counts) is
checked by ``decode``; ``reader(fields)`` builds the typed record and is written with the checked
conversions of wire_fields.py, so every value that reaches the receiver was checked.

What a hostile frame can do: raise ``WireError`` and nothing else (the receiver drops the frame
and counts it in its ``WireStats``). msgpack builds only plain values (nil, bool, int, float, str,
bin, array, map with str keys: no object construction, no import, no code); the frame's size is
checked before a byte is parsed; every length inside it is bounded by the frame; an unknown
type, a wrong arity, an extension other than ``Array`` or an ``Array`` whose dtype is not allowed
or whose shape does not match its bytes is refused; any exception of the unpacker, or of a
type's reader, becomes a ``WireError``. ``decode(..., allowed=...)`` (before authentication)
reads the type from the frame's first bytes and refuses any other type without parsing the body.

``Array`` carries a numpy array or a torch tensor as dtype + shape + raw little-endian bytes
(bfloat16 included), received as a read-only view of the frame (no copy). Nothing here imports
torch: the coordinator and clients use this module without it."""
from __future__ import annotations

import functools
import struct
from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable

import msgpack

RANGES = {"handshake": range(1, 16), "ranks": range(16, 32), "control plane": range(32, 96),
          "server front-ends": range(96, 112)}
"""Which concern registers which message type values."""

EXT_ARRAY = 1
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
"""Element types an ``Array`` may carry (index = wire code)."""
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
            "float32": 4, "float64": 8}
MAX_NDIM = 8
_ARRAY_HEAD = struct.Struct("<BB")  # dtype code, ndim; then ndim little-endian uint64 dims, then the bytes


class WireError(ValueError):
    """A frame that is not a valid message; ``reason`` names the counter it is dropped into."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class WireStats:
    """What a receiving socket dropped and whom it refused. One per socket; whoever reports it
    (``EngineStats``, the coordinator's counters) reads it when asked."""

    frames: int = 0
    """Frames received (every one, dropped or not)."""
    dropped: Counter = field(default_factory=Counter)
    """reason -> frames dropped: "oversized", "undecodable", "malformed", "unknown type",
    "unauthenticated", "bad hello", "bad field", "wrong role", "reply undeliverable", ..."""
    authenticated: int = 0
    auth_failed: int = 0
    """Handshakes whose proof was wrong, or whose name is not allowed or already taken."""
    stranger_disconnects: int = 0
    """Connections that closed without being an authenticated peer (nothing else happens)."""

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True, eq=False)
class MessageType:
    value: int
    name: str
    arity: tuple[int, ...] | None = None
    """Allowed numbers of fields after the type (None: any)."""
    reader: Callable[[list], Any] | None = None

    def read(self, fields: list) -> Any:
        """The typed record of ``fields`` (``decode``'s second item), or ``WireError``: any
        exception of the reader counts as a bad field (a reader's bug must not end a loop)."""
        if self.reader is None:
            return fields
        try:
            return self.reader(fields)
        except WireError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WireError("bad field", f"{self.name}: {type(e).__name__}") from None

    def __repr__(self) -> str:
        return f"<message {self.name}={self.value}>"


_TYPES: dict[int, MessageType] = {}
_NAMES: dict[str, MessageType] = {}


def message_type(name: str, value: int, arity: int | tuple[int, ...] | None = None,
                 reader: Callable[[list], Any] | None = None) -> MessageType:
    """Register a message type (module level, once). Raises ValueError for a value or name
    already taken, or a value outside 1-127 (it must fit the positive fixint the pre-auth peek
    reads)."""
    if type(value) is not int or not 0 < value < 0x80:
        raise ValueError(f"message type values are 1-127, got {value!r}")
    if value in _TYPES or name in _NAMES:
        raise ValueError(f"message type {name}={value} collides with {_TYPES.get(value) or _NAMES[name]}")
    mt = MessageType(value, name, (arity,) if isinstance(arity, int) else arity, reader)
    _TYPES[value] = _NAMES[name] = mt
    return mt


def registered(name: str) -> MessageType:
    return _NAMES[name]


def reader(fn: Callable) -> Callable:
    """A record reader whose every exception is a ``WireError`` (its own, or "bad field"): a
    reader's bug or an unforeseen value must not end the receiving loop."""
    @functools.wraps(fn)
    def read(*args):
        try:
            return fn(*args)
        except WireError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WireError("bad field", f"{fn.__name__}: {type(e).__name__}") from None
    return read


# ---------------------------------------------------------------------- Array
@dataclass(frozen=True)
class Array:
    """A numpy array / torch tensor on the wire. ``data``: its raw bytes (a read-only view of the
    received frame)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def of(cls, x) -> Array:
        """From a numpy array or a CPU torch tensor (made contiguous; bfloat16 kept as its bits)."""
        if type(x).__module__.startswith("torch"):
            name = str(x.dtype).removeprefix("torch.")
            t = x.detach().contiguous()
            if name == "bfloat16":
                import torch

                t = t.view(torch.int16)
            raw = t.numpy()
            return cls(name, tuple(t.shape), memoryview(raw.reshape(-1)).cast("B"))
        import numpy as np

        a = np.ascontiguousarray(x)
        return cls(a.dtype.name, tuple(a.shape), memoryview(a.reshape(-1)).cast("B"))

    def numpy(self):
        import numpy as np

        if self.dtype == "bfloat16":
            raise TypeError("numpy has no bfloat16: use .torch()")
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def torch(self):
        import torch

        dtype = getattr(torch, self.dtype)
        if not len(self.data):
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


def _pack_array(a: Array) -> msgpack.ExtType:
    if a.dtype not in ITEMSIZE or len(a.shape) > MAX_NDIM:
        raise TypeError(f"cannot send an array of {a.dtype} with {len(a.shape)} dims")
    head = _ARRAY_HEAD.pack(DTYPES.index(a.dtype), len(a.shape)) + struct.pack(f"<{len(a.shape)}Q", *a.shape)
    return msgpack.ExtType(EXT_ARRAY, head + bytes(a.data))


def _default(obj):
    if isinstance(obj, Array):
        return _pack_array(obj)
    if isinstance(obj, memoryview):
        return obj.tobytes()
    raise TypeError(f"no wire encoding for {type(obj).__name__}: a message type's fields are plain values")


def _ext_hook(code: int, data: bytes):
    if code != EXT_ARRAY or len(data) < _ARRAY_HEAD.size:
        raise WireError("undecodable", f"extension {code}")
    dtype_code, ndim = _ARRAY_HEAD.unpack_from(data)
    if dtype_code >= len(DTYPES) or ndim > MAX_NDIM or len(data) < _ARRAY_HEAD.size + 8 * ndim:
        raise WireError("undecodable", "array header")
    shape = struct.unpack_from(f"<{ndim}Q", data, _ARRAY_HEAD.size)
    body = memoryview(data)[_ARRAY_HEAD.size + 8 * ndim:]
    dtype = DTYPES[dtype_code]
    if prod(shape) * ITEMSIZE[dtype] != len(body):  # Python ints: no overflow
        raise WireError("undecodable", "array shape does not match its bytes")
    return Array(dtype, shape, body)


# ---------------------------------------------------------------------- frames
_PACKER = msgpack.Packer(default=_default, use_bin_type=True, autoreset=True)


def encode(mtype: MessageType, *fields) -> bytes:
    """``[mtype, *fields]`` as one frame (bytes travel as bin, str as str, ``Array`` as its extension)."""
    return _PACKER.pack([mtype.value, *fields])


def pack(value) -> bytes:
    """A plain value (no message type) as msgpack: a record stored inside another message or in
    shared memory; read back with ``unpack``."""
    return _PACKER.pack(value)


def unpack(data: bytes | memoryview, max_bytes: int):
    """``pack``'s value back, with ``decode``'s limits and errors."""
    n = len(data)
    if n > max_bytes:
        raise WireError("oversized", f"{n} bytes > {max_bytes}")
    try:
        return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True, ext_hook=_ext_hook,
                               max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 -- ValueError, TypeError, StackError, UnicodeDecodeError, ...
        raise WireError("undecodable", type(e).__name__) from None


def decode(frame: bytes | memoryview, max_bytes: int, allowed: frozenset[MessageType] | None = None
           ) -> tuple[MessageType, list]:
    """``(type, fields after the type)`` of one frame, or ``WireError``. ``allowed``: the only
    types taken; any other is refused from the frame's first bytes, its body never parsed."""
    if allowed is not None:
        if len(frame) > max_bytes:
            raise WireError("oversized", f"{len(frame)} bytes > {max_bytes}")
        peek = peek_type(frame)
        if peek is None or peek not in allowed:
            raise WireError("unauthenticated" if peek is not None else "malformed", "type not allowed here")
    obj = unpack(frame, max_bytes)
    if type(obj) is not list or not obj:
        raise WireError("malformed", "not a [type, ...] array")
    mtype = _TYPES.get(obj[0]) if type(obj[0]) is int else None
    if mtype is None:
        raise WireError("unknown type", repr(obj[0])[:20])
    del obj[0]
    if mtype.arity is not None and len(obj) not in mtype.arity:
        raise WireError("malformed", f"{mtype.name} with {len(obj)} fields")
    return mtype, obj


def peek_type(frame: bytes | memoryview) -> MessageType | None:
    """The type of ``[type, ...]`` from the frame's first bytes (fixarray / array16 / array32,
    then a positive fixint) without parsing the rest; None when it does not start that way."""
    if len(frame) < 2:
        return None
    b0 = frame[0]
    at = 1 if 0x90 <= b0 <= 0x9F else 3 if b0 == 0xDC else 5 if b0 == 0xDD else None
    if at is None or len(frame) <= at or frame[at] > 0x7F:
        return None
    return _TYPES.get(frame[at])
