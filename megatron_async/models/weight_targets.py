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


class Piece(NamedTuple):
    """A piece of a full tensor as a plan sees it."""

    box: Box
    meets: tuple[tuple[int, Box, slice | tuple[slice, ...] | None, tuple[slice, ...]], ...]
    """Per destination the piece meets: (its index, the intersection, the index of the
    destination view (``_index``), the source slices)."""
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
              origin: tuple[int, ...] | None) -> Piece | None:
        """The piece ``offset`` .. ``offset + extent`` of ``info``'s full tensor (at ``origin`` of
        the tensor that holds it): its box, where it meets the destinations and the elements it
        brings this rank; None where it lies outside the full tensor."""
        key = (info.kind, offset, extent, origin)
        found = self._pieces.get(key, self)
        if found is self:
            if len(self._pieces) > 65536:  # distinct piece geometries: bounded for any model
                self._pieces.clear()
            found = self._pieces[key] = _piece(info, offset, extent, origin)
        return found


def _piece(info: TargetInfo, offset: tuple[int, ...], extent: tuple[int, ...],
           origin: tuple[int, ...] | None) -> Piece | None:
    if not all(0 <= a and 0 < e and a + e <= n for a, e, n in zip(offset, extent, info.full_shape)):
        return None
    box = Box.of(offset, extent)
    meets = []
    base = [o - (g or 0) for o, g in zip(offset, origin or (0,) * len(offset))]
    for i, dest in enumerate(info.dests):
        both = dest.box.intersect(box)
        if both is None:
            continue
        dst = _index(both, dest.box)
        src = tuple(slice(a - o, b - o) for a, b, o in zip(both.lo, both.hi, base))
        meets.append((i, both, dst, src))
    return Piece(box, tuple(meets), sum(m[1].numel for m in meets))


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
