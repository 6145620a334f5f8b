"""What a weight plan asks of the model, worked out once per HF name and kept: whether the name
is skipped, its canonical name, the parameter and shard it fills, the full shape, this rank's
destinations (boxes and views) and which source dtypes they take; and, per piece geometry, the
(destination, intersection, source slice) a piece of that box makes. A plan looks each piece up
here instead of asking the model (``hf_targets`` walks every parameter; ``destinations`` builds
views) and intersecting boxes per piece; pieces of equal geometry (every layer of a model) share
one entry. The engine keeps one table from its start (``CopyPlanCache.table``); it is rebuilt
when a parameter's storage moved, as the plans are."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from megatron_async.parallel.sharding import Box, Destination, destinations, full_shape

SKIPPED = object()
"""``TargetTable.lookup``'s answer for a name the model does not need."""


def plain_dtype(dtype: torch.dtype) -> bool:
    """Source dtypes a plain destination takes: 16- to 64-bit floating point (a value copy;
    8-bit floats carry scales only a transform knows, integers are no weights)."""
    return dtype.is_floating_point and dtype.itemsize >= 2


class TargetInfo:
    """One HF tensor of the model: its parameter, shard, full shape and destinations."""

    __slots__ = ("name", "param", "shard_id", "full_shape", "dests", "need", "kind", "_dtypes")

    def __init__(self, name: str, param: nn.Parameter, shard_id, kinds: dict[tuple, int]):
        self.name, self.param, self.shard_id = name, param, shard_id
        self.full_shape = full_shape(param, shard_id)
        self.dests: list[Destination] = destinations(param, shard_id)
        self.need = sum(d.box.numel for d in self.dests)
        self.kind = kinds.setdefault((self.full_shape, *((d.box.lo, d.box.hi) for d in self.dests)), len(kinds))
        """Equal for tensors of equal full shape and destination boxes: their pieces' geometry is equal."""
        self._dtypes: dict[torch.dtype, bool] = {}

    def accepts(self, dtype: torch.dtype) -> bool:
        ok = self._dtypes.get(dtype)
        if ok is None:
            sinks = [d.sink for d in self.dests if d.sink is not None]
            ok = self._dtypes[dtype] = all(s.accepts(dtype) for s in sinks) if sinks else plain_dtype(dtype)
        return ok


class Chunks(NamedTuple):
    """The source of a copy whose box a slab reads in chunks (``Slab.chunk``): ``count`` chunks of
    ``rows`` rows along dim 0, chunk k from row ``start + k * stride`` of the caller's tensor,
    ``rest`` the slices of its other dims. Its destination is viewed as (count, rows, ...)."""

    start: int
    count: int
    rows: int
    stride: int
    rest: tuple[slice, ...]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The (count, rows, ...) strided view of ``tensor`` (no copy)."""
        return tensor.as_strided(*self.geometry(tensor.size(0), tensor.stride(), tensor.storage_offset()))

    def geometry(self, rows: int, stride: tuple[int, ...], offset: int) -> tuple[list[int], tuple[int, ...], int]:
        """``as_strided``'s (size, stride, offset) of ``of`` for a tensor of ``rows`` rows, ``stride``
        and storage ``offset``."""
        if self.start + (self.count - 1) * self.stride + self.rows > rows:
            raise ValueError(f"a tensor of {rows} rows given where the plan reads {self}")
        offset, size = offset + self.start * stride[0], [self.count, self.rows]
        for s, x in zip(self.rest, stride[1:]):
            offset += s.start * x
            size.append(s.stop - s.start)
        return size, (self.stride * stride[0], *stride), offset

    def slices(self, k: int) -> tuple[slice, ...]:
        """Chunk k as the source slices of a plain copy."""
        return (slice(self.start + k * self.stride, self.start + k * self.stride + self.rows), *self.rest)


class Strided(NamedTuple):
    """A source tensor described by integers, not made yet: ``base.as_strided(shape, stride,
    offset)`` (a tensor of a storage shared over IPC). ``piece`` makes the part a copy reads in one
    view instead of a view of a view: a first update binds a few hundred."""

    base: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        return self.base.as_strided(self.shape, self.stride, self.offset)

    def piece(self, src: tuple[slice, ...] | Chunks) -> torch.Tensor:
        """``tensor()[src]``, or ``src.of(tensor())`` for ``Chunks``, as one view."""
        if type(src) is Chunks:
            return self.base.as_strided(*src.geometry(self.shape[0], self.stride, self.offset))
        shape, stride, offset = self.shape, self.stride, self.offset
        size = list(shape)
        for i, s in enumerate((src,) if type(src) is slice else src):
            start, stop, step = s.indices(shape[i])
            if step != 1:
                return self.tensor()[src]
            offset += start * stride[i]
            size[i] = max(stop - start, 0)
        return self.base.as_strided(size, stride, offset)


class Piece(NamedTuple):
    """A piece of a full tensor as a plan sees it."""

    box: Box
    meets: tuple[tuple[int, Box, slice | tuple[slice, ...] | None, tuple[slice, ...] | Chunks], ...]
    """Per destination the piece meets: (its index, the intersection, the index of the
    destination view (``_index``), the source slices or ``Chunks``)."""
    elements: int
    """Elements of this rank's destinations it covers."""


class TargetTable:
    """The lookups of one model (``targets`` / ``skip`` / ``canonical`` default to its
    ``hf_targets()``, ``skips_hf_name``, ``canonical_name``)."""

    def __init__(self, model: nn.Module | None, targets: dict | None = None,
                 skip: Callable[[str], bool] | None = None, canonical: Callable[[str], str] | None = None):
        self.model = model
        self.targets = targets if targets is not None else model.hf_targets()
        self.skip = skip or getattr(model, "skips_hf_name", lambda name: False)
        self.canonical = canonical or getattr(model, "canonical_name", lambda name: name)
        self._names: dict[str, object] = {}
        self._infos: dict[str, TargetInfo] = {}
        self._pieces: dict[tuple, Piece | None] = {}
        self._kinds: dict[tuple, int] = {}
        params = {id(p): p for p, _ in self.targets.values()}.values()
        self._ptrs = tuple((p, p.data_ptr()) for p in params)

    def valid(self) -> bool:
        """Whether every parameter still has the storage the destination views were made of."""
        return all(p.data_ptr() == ptr for p, ptr in self._ptrs)

    def warm(self) -> TargetTable:
        """Look up every name the model needs now (at engine start) instead of at the first update."""
        for name in self.targets:
            self.lookup(name)
        return self

    def lookup(self, name: str):
        """``SKIPPED``, None (unknown name) or the ``TargetInfo`` of ``name`` (any spelling)."""
        found = self._names.get(name, self)
        if found is self:
            found = self._names[name] = self._resolve(name)
        return found

    def _resolve(self, name: str):
        if self.skip(name):
            return SKIPPED
        canonical = self.canonical(name)
        info = self._infos.get(canonical)
        if info is None and canonical in self.targets:
            info = self._infos[canonical] = TargetInfo(canonical, *self.targets[canonical], self._kinds)
        return info

    def piece(self, info: TargetInfo, offset: tuple[int, ...], extent: tuple[int, ...],
              origin: tuple[int, ...] | None, chunk: tuple[int, int] | None = None) -> Piece | None:
        """The piece ``offset`` .. ``offset + extent`` of ``info``'s full tensor (at ``origin`` of
        the tensor that holds it, read in ``chunk``s: ``Slab.chunk``): its box, where it meets
        the destinations and the elements it brings this rank; None where it lies outside the
        full tensor."""
        key = (info.kind, offset, extent, origin, chunk)
        found = self._pieces.get(key, self)
        if found is self:
            if len(self._pieces) > 65536:  # distinct piece geometries: bounded for any model
                self._pieces.clear()
            found = self._pieces[key] = _piece(info, offset, extent, origin, chunk)
        return found


def _piece(info: TargetInfo, offset: tuple[int, ...], extent: tuple[int, ...],
           origin: tuple[int, ...] | None, chunk: tuple[int, int] | None) -> Piece | None:
    if not all(0 <= a and 0 < e and a + e <= n for a, e, n in zip(offset, extent, info.full_shape)):
        return None
    box = Box.of(offset, extent)
    origin = origin or (0,) * len(offset)
    meets = []
    for i, dest in enumerate(info.dests):
        both = dest.box.intersect(box)
        if both is None:
            continue
        if chunk is None:
            meets.append(_meet(i, dest, both, [o - g for o, g in zip(offset, origin)]))
            continue
        rows, stride = chunk
        a, b = both.lo[0] - offset[0], both.hi[0] - offset[0]
        if dest.sink is None and a % rows == 0 and b % rows == 0 and b - a > rows:  # whole chunks: one copy
            rest = tuple(slice(lo - o + g, hi - o + g) for lo, hi, o, g in zip(both.lo[1:], both.hi[1:], offset[1:], origin[1:]))
            meets.append((i, both, _index(both, dest.box), Chunks(origin[0] + a // rows * stride, (b - a) // rows, rows, stride, rest)))
            continue
        for k in range(a // rows, -(-b // rows)):  # a plain copy per chunk (a sink takes boxes, or a cut chunk)
            sub = Box.of((offset[0] + k * rows, *offset[1:]), (rows, *extent[1:])).intersect(both)
            base = [offset[0] + k * rows - origin[0] - k * stride] + [o - g for o, g in zip(offset[1:], origin[1:])]
            meets.append(_meet(i, dest, sub, base))
    return Piece(box, tuple(meets), sum(m[1].numel for m in meets))


def _meet(i: int, dest: Destination, both: Box, base: list[int]) -> tuple:
    """Destination ``i``'s part ``both`` as a plain copy from source rows ``both - base``."""
    return i, both, _index(both, dest.box), tuple(slice(a - o, b - o) for a, b, o in zip(both.lo, both.hi, base))


def _index(both: Box, dest: Box) -> slice | tuple[slice, ...] | None:
    """The part ``both`` of the view of ``dest``: None (all of it), the rows of dim 0 (a basic
    slice: half the cost of a tuple index) or a slice per dim."""
    cut = [(a - lo, b - lo) for a, b, lo in zip(both.lo, both.hi, dest.lo)]
    full = [c == (0, hi - lo) for c, lo, hi in zip(cut, dest.lo, dest.hi)]
    if all(full):
        return None
    if all(full[1:]):
        return slice(*cut[0])
    return tuple(slice(a, b) for a, b in cut)
