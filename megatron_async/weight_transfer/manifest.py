"""The manifest of a bucketed weight transfer: plain JSON, no pickle, the same on every rank.

An update is a list of buckets, each broadcast by its ``src`` rank as one flat byte tensor of
``nbytes``; every tensor of a bucket sits at a byte ``offset`` (a multiple of ``ALIGN``) with its
name, dtype, shape and shard (Megatron-Core TP / EP / expert-TP ranks, pipeline layer offset).
A tensor larger than a bucket travels as pieces of whole rows of dim 0 (``rows``), so no bucket
exceeds ``bucket_bytes`` and a receiver never holds more than one bucket beyond the model.

    {"weights_format": "megatron", "version": 12,
     "buckets": [{"src": 0, "nbytes": 4096,
                  "tensors": [{"name": "decoder.layers.3.self_attention.linear_qkv.weight",
                               "dtype": "bfloat16", "shape": [2560, 4096], "offset": 0,
                               "tp_rank": 1, "tp_size": 4, "rows": [0, 256]}]}]}

``Manifest.from_json`` is strict (every field typed and in range, offsets inside their bucket,
no two tensors overlapping): anything else is a ``ManifestError`` (a 400 on the server)."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import torch

from megatron_async.models.megatron_layouts import Shard

ALIGN = 64
"""Byte alignment of every tensor inside a bucket."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}
"""Dtypes a manifest may name (whether the engine takes one is the loader's decision)."""
FORMATS = ("megatron", "hf")
_SHARD_FIELDS = ("tp_rank", "tp_size", "ep_rank", "ep_size", "etp_rank", "etp_size", "layer_offset")


class ManifestError(ValueError):
    """A malformed manifest."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset in its bucket (a multiple of ALIGN)."""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    etp_size: int | None = None
    layer_offset: int = 0
    rows: tuple[int, int] | None = None
    """Rows [start, stop) of dim 0 of the tensor of ``shape`` (a piece); None: the whole tensor."""

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return self.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.piece_shape) * DTYPES[self.dtype].itemsize

    @property
    def shard(self) -> Shard:
        return Shard(**{k: getattr(self, k) for k in _SHARD_FIELDS})

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Bucket:
    src: int
    """The transfer-group rank that broadcasts it."""
    nbytes: int
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True)
class Manifest:
    weights_format: str
    buckets: tuple[Bucket, ...]
    version: int | None = None

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    def entries(self) -> list[TensorEntry]:
        return [e for b in self.buckets for e in b.tensors]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> int:
        """63-bit hash of the canonical JSON (every rank must hold the same manifest)."""
        return int.from_bytes(hashlib.sha256(self.to_json().encode()).digest()[:8], "big") >> 1

    @classmethod
    def from_json(cls, text: str | bytes | Mapping | Manifest) -> Manifest:
        """Strict parse (see the module docstring); ``ManifestError`` naming the first problem."""
        if isinstance(text, Manifest):
            return text
        try:
            obj = json.loads(text) if isinstance(text, (str, bytes)) else text
            return _parse(obj)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ManifestError(f"malformed manifest: {e!r}") from None


def check_int(x, what: str, optional: bool = False, error: type[ValueError] = ManifestError) -> int | None:
    """``x`` if it is an int >= 0 (or None when ``optional``); else ``error`` naming ``what``."""
    if optional and x is None:
        return None
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise error(f"{what} must be an int >= 0, got {x!r}")
    return x


_int = check_int


def _entry(t: Mapping, nbytes: int) -> TensorEntry:
    if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
        raise ManifestError(f"a tensor entry needs a string 'name', got {t!r}")
    unknown = set(t) - {"name", "dtype", "shape", "offset", "rows", *_SHARD_FIELDS}
    if unknown:
        raise ManifestError(f"{t['name']}: unknown fields {sorted(unknown)}")
    if t.get("dtype") not in DTYPES:
        raise ManifestError(f"{t['name']}: dtype must be one of {sorted(DTYPES)}, got {t.get('dtype')!r}")
    if not isinstance(t.get("shape"), list):
        raise ManifestError(f"{t['name']}: shape must be a list")
    rows = t.get("rows")
    if rows is not None:
        if not (isinstance(rows, list) and len(rows) == 2):
            raise ManifestError(f"{t['name']}: rows must be [start, stop]")
        rows = (_int(rows[0], "rows"), _int(rows[1], "rows"))
    shard = {k: _int(t[k], f"{t['name']}: {k}", k.startswith("etp")) for k in _SHARD_FIELDS if k in t}
    e = TensorEntry(t["name"], t["dtype"], tuple(_int(x, f"{t['name']}: shape") for x in t["shape"]),
                    _int(t.get("offset"), f"{t['name']}: offset"), rows=rows, **shard)
    if rows is not None and not (e.shape and rows[0] < rows[1] <= e.shape[0]):
        raise ManifestError(f"{e.name}: rows {list(rows)} outside dim 0 of {list(e.shape)}")
    if e.offset % ALIGN or e.offset + e.nbytes > nbytes:
        raise ManifestError(f"{e.name}: offset {e.offset} is not a multiple of {ALIGN} or reaches beyond its bucket")
    try:
        e.shard
    except ValueError as err:
        raise ManifestError(f"{e.name}: {err}") from None
    return e


def _parse(obj: Mapping) -> Manifest:
    if not isinstance(obj, Mapping):
        raise ManifestError("a manifest is a JSON object")
    fmt = obj.get("weights_format")
    if fmt not in FORMATS:
        raise ManifestError(f"weights_format must be one of {FORMATS}, got {fmt!r}")
    version = _int(obj.get("version"), "version", optional=True)
    if not isinstance(obj.get("buckets"), list):
        raise ManifestError("buckets must be a list")
    buckets = []
    for b in obj["buckets"]:
        if not isinstance(b, Mapping) or not isinstance(b.get("tensors"), list):
            raise ManifestError(f"a bucket needs src, nbytes and a list of tensors, got {b!r}")
        nbytes = _int(b.get("nbytes"), "bucket nbytes")
        tensors = tuple(_entry(t, nbytes) for t in b["tensors"])
        spans = sorted((e.offset, e.offset + e.nbytes) for e in tensors)
        if any(a[1] > c[0] for a, c in zip(spans, spans[1:])):
            raise ManifestError("two tensors overlap inside a bucket")
        buckets.append(Bucket(_int(b.get("src"), "bucket src"), nbytes, tensors))
    return Manifest(fmt, tuple(buckets), version)


def build_manifest(items: Iterable[tuple], bucket_bytes: int = 512 << 20, src: int = 0,
                   weights_format: str = "megatron", version: int | None = None) -> Manifest:
    """Pack (name, tensor[, Shard]) items, in order, into buckets of at most ``bucket_bytes``
    broadcast by rank ``src``; a tensor bigger than a bucket goes in pieces of whole rows."""
    if weights_format not in FORMATS:
        raise ManifestError(f"weights_format must be one of {FORMATS}, got {weights_format!r}")
    buckets, cur, used = [], [], 0
    for name, t, *rest in items:
        shard = rest[0] if rest and rest[0] is not None else Shard()
        fields = {k: getattr(shard, k) for k in _SHARD_FIELDS}
        dtype = str(t.dtype).removeprefix("torch.")
        total = t.numel() * t.element_size()
        row_bytes = total // max(t.shape[0], 1) if t.dim() else total
        if total <= bucket_bytes or t.dim() == 0:
            pieces = [None]
        else:
            if row_bytes > bucket_bytes:
                raise ManifestError(f"{name}: one row ({row_bytes} B) exceeds bucket_bytes ({bucket_bytes})")
            per = bucket_bytes // row_bytes
            pieces = [(a, min(a + per, t.shape[0])) for a in range(0, t.shape[0], per)]
        for rows in pieces:
            n = total if rows is None else (rows[1] - rows[0]) * row_bytes
            start = -(-used // ALIGN) * ALIGN
            if cur and start + n > bucket_bytes:
                buckets.append(Bucket(src, used, tuple(cur)))
                cur, used, start = [], 0, 0
            cur.append(TensorEntry(name, dtype, tuple(t.shape), start, rows=rows, **fields))
            used = start + n
    if cur:
        buckets.append(Bucket(src, used, tuple(cur)))
    return Manifest(weights_format, tuple(buckets), version)


def merge(manifests: Iterable[Manifest | Mapping | str]) -> Manifest:
    """One manifest from several senders' (each bucket keeps its ``src``)."""
    parsed = [Manifest.from_json(m) for m in manifests]
    if not parsed or len({(m.weights_format, m.version) for m in parsed}) != 1:
        raise ManifestError("merge needs manifests with the same weights_format and version")
    return Manifest(parsed[0].weights_format, tuple(b for m in parsed for b in m.buckets), parsed[0].version)
