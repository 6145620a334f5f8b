"""Checked conversions of decoded wire values into plain Python types, for message readers.

Each raises ``WireError("bad field", name)`` on a value of the wrong kind or range, so a reader
is a list of these calls and nothing else: no value reaches the receiver unchecked. Token lists
and other long int / float lists travel as little-endian int64 / float64 ``bin`` (``pack_ints``,
``pack_floats``: one C conversion each way); short int lists as msgpack arrays (``int_list``)."""
from __future__ import annotations

import struct
import sys
from array import array

from megatron_async.inference.communication.wire import Array, WireError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SWAP = sys.byteorder != "little"


def bad(name: str) -> WireError:
    return WireError("bad field", name)


def arity(fields: list, n: int, name: str) -> list:
    """``fields`` has exactly ``n`` entries (unpack it in the same line)."""
    if type(fields) is not list or len(fields) != n:
        raise WireError("malformed", f"{name}: want {n} fields")
    return fields


def int_(v, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise bad(name)
    return v


def opt_int(v, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    return None if v is None else int_(v, name, lo, hi)


def float_(v, name: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise bad(name)


def bool_(v, name: str) -> bool:
    if type(v) is not bool:
        raise bad(name)
    return v


def str_(v, name: str, max_len: int | None = None) -> str:
    if type(v) is not str or (max_len is not None and len(v) > max_len):
        raise bad(name)
    return v


def opt_str(v, name: str) -> str | None:
    return None if v is None else str_(v, name)


def bytes_(v, name: str, size: int | None = None) -> bytes:
    if type(v) is not bytes or (size is not None and len(v) != size):
        raise bad(name)
    return v


def list_(v, name: str, max_len: int | None = None) -> list:
    if type(v) is not list or (max_len is not None and len(v) > max_len):
        raise bad(name)
    return v


def dict_(v, name: str) -> dict:
    if type(v) is not dict:
        raise bad(name)
    return v


def int_list(v, name: str, max_len: int = 1 << 16) -> list[int]:
    """A short msgpack array of ints (cheaper than int64 bin at a dozen values)."""
    if type(v) is not list or len(v) > max_len:
        raise bad(name)
    for x in v:
        if type(x) is not int:
            raise bad(name)
    return v


def _unpack(v, name: str, code: str) -> list:
    if type(v) is not bytes or len(v) % 8:
        raise bad(name)
    a = array(code)
    a.frombytes(v)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def _pack(xs, code: str) -> bytes:
    if type(xs) is not list and type(xs) is not tuple:
        xs = list(xs)
    try:
        return struct.pack(f"<{len(xs)}{code}", *xs)  # (3x faster than an array's conversion)
    except struct.error:  # a value out of range or of the wrong kind: the array's error (OverflowError, TypeError)
        a = array(code, xs)
        if _SWAP:
            a.byteswap()
        return a.tobytes()


def packed(v, name: str) -> bytes:
    """An int64 / float64 bin as it travels: checked as ``ints`` and ``floats`` check it (every
    8 bytes is a value), not converted (a relay passes it on as it came)."""
    if type(v) is not bytes or len(v) % 8:
        raise bad(name)
    return v


def ints(v, name: str) -> list[int]:
    """int64 little-endian bin -> list of ints."""
    return _unpack(v, name, "q")


def floats(v, name: str) -> list[float]:
    """float64 little-endian bin -> list of floats."""
    return _unpack(v, name, "d")


def pack_ints(xs) -> bytes:
    return _pack(xs, "q")


def pack_floats(xs) -> bytes:
    return _pack(xs, "d")


def arr(v, name: str, dtypes: tuple[str, ...] | None = None, ndim: int | None = None) -> Array:
    if type(v) is not Array or (dtypes is not None and v.dtype not in dtypes) or (ndim is not None and len(v.shape) != ndim):
        raise bad(name)
    return v


def plain(v, name: str, max_depth: int = 4, depth: int = 0):
    """A structure of scalars, lists and str-keyed maps at most ``max_depth`` deep (a JSON-like
    argument: stop words, a structured-output spec, an admin operation's arguments)."""
    if v is None or type(v) in (bool, int, float, str, bytes):
        return v
    if depth >= max_depth:
        raise bad(name)
    if type(v) is list:
        return [plain(x, name, max_depth, depth + 1) for x in v]
    if type(v) is dict:
        return {k: plain(x, name, max_depth, depth + 1) for k, x in v.items()}
    raise bad(name)
