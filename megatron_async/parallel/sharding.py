"""How one parameter is cut from FULL Hugging Face tensors, and its ``weight_loader``.

Every parameter of a parallel layer carries ``param.weight_loader(param, loaded_weight,
shard_id=None)`` (the nano-vllm / vLLM protocol): ``loaded_weight`` is the full checkpoint
tensor, ``shard_id`` names which of the HF tensors stacked into this parameter it is (q / k /
v of a fused qkv, gate / up of a fused MLP; None = the parameter's whole full tensor). The
loader keeps this rank's slice and raises ValueError on a mis-shaped tensor. A parameter
along whose ``dim`` several parts are concatenated holds, in part order, this rank's equal
slice of every part: that is how q/k/v heads, gate/up columns and Mamba's z/x/B/C/dt
channels stay aligned on each rank.

Every load is a box copy: ``Sharding.destinations(target, shard_id)`` gives the boxes of the
full HF tensor this rank holds (one per part for a fused tensor loaded whole) and the views of
the parameter they land in; ``weight_loader`` copies the intersection of a full tensor with
each, and the slab loader (``models/slab_loading.py``) does the same for pieces of a tensor
(Megatron TP shards, transfer buckets). One geometry, whatever the source."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import nn

from megatron_async.parallel.state import ParallelState

ShardId = Hashable


@dataclass(frozen=True)
class Box:
    """Rows [lo, hi) of each dim of a full tensor."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @classmethod
    def of(cls, offset: tuple[int, ...], extent: tuple[int, ...]) -> Box:
        return cls(tuple(offset), tuple(o + e for o, e in zip(offset, extent)))

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi))
        return Box(lo, hi) if all(a < b for a, b in zip(lo, hi)) else None

    @property
    def numel(self) -> int:
        n = 1
        for a, b in zip(self.lo, self.hi):
            n *= b - a
        return n


class BoxSet:
    """Boxes of one full tensor, telling whether a new one overlaps any held (``add``) without
    comparing it with all of them: they are kept sorted by their start along one dim (the first
    box's cut dim), and only those that start within the longest extent seen before its end can
    overlap it; one that starts at or after every held box's end is clear at once (pieces in
    order). Pieces of a tensor (TP shards, query groups, buckets) are cut along one dim, so a
    check looks at a few neighbours instead of every box (a 0.6B plan: 4,148 box tests -> none)."""

    def __init__(self, full_shape: tuple[int, ...]):
        self.full_shape = tuple(full_shape)
        self.boxes: list[Box] = []
        self._dim = 0
        self._starts: list[tuple[int, int]] = []  # (lo along _dim, index in boxes), sorted
        self._longest = 0
        self._end = 0  # the largest end along _dim

    def add(self, box: Box) -> bool:
        """Keep ``box``; False where it overlaps a box already held (it is kept all the same)."""
        if not self.boxes:
            self._dim = next((d for d, (a, b, n) in enumerate(zip(box.lo, box.hi, self.full_shape)) if b - a < n), 0)
        d, starts = self._dim, self._starts
        lo, hi = box.lo[d], box.hi[d]
        if lo >= self._end:  # past every held box along the dim (pieces in order): nothing to test
            starts.append((lo, len(self.boxes)))
            self.boxes.append(box)
            self._longest, self._end = max(self._longest, hi - lo), hi
            return True
        at = bisect.bisect_left(starts, (lo, -1))
        clear = True
        for i in range(at - 1, -1, -1):  # starting before it: only within the longest extent
            start, k = starts[i]
            if start <= lo - self._longest:
                break
            if box.intersect(self.boxes[k]) is not None:
                clear = False
                break
        if clear:
            for start, k in starts[at:]:  # starting at or after it, before its end
                if start >= hi:
                    break
                if box.intersect(self.boxes[k]) is not None:
                    clear = False
                    break
        starts.insert(at, (lo, len(self.boxes)))
        self.boxes.append(box)
        self._longest, self._end = max(self._longest, hi - lo), max(self._end, hi)
        return clear


@dataclass(frozen=True)
class Destination:
    """Where this rank keeps its part of one full HF tensor: ``box`` of the full tensor lands
    in ``view`` (a view of the parameter, of the box's shape). ``sink``: None = a plain copy;
    else the object that writes pieces into ``view`` itself (a transform such as quantization,
    staging; see ``models/slab_loading.py`` for the protocol)."""

    box: Box
    view: torch.Tensor
    sink: Any = None


@dataclass(frozen=True)
class Sharding:
    dim: int | None
    """The split dim; None = replicated (every rank holds the full tensor)."""
    full_sizes: tuple[int, ...] = ()
    """Full size of each part along ``dim``, in the order they are concatenated."""
    shard_ids: tuple[ShardId, ...] = ()
    """The ``shard_id`` of each part; () = one part, loaded with shard_id None."""
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def split(cls, dim: int, full_sizes: tuple[int, ...] | int, parallel: ParallelState, what: str,
              shard_ids: tuple[ShardId, ...] = ()) -> Sharding:
        """Each part split evenly over the TP ranks; ValueError naming ``what`` if one does not divide."""
        sizes = (full_sizes,) if isinstance(full_sizes, int) else tuple(full_sizes)
        for size in sizes:
            parallel.tp_divide(size, what)
        return cls(dim, sizes, shard_ids, parallel.tp_rank, parallel.tp_size)

    def _part(self, shard_id: ShardId) -> int | None:
        if shard_id is None:
            return None
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard_id {shard_id!r} (this parameter stacks {list(self.shard_ids)})")
        return self.shard_ids.index(shard_id)

    def full_shape(self, local_shape: tuple[int, ...], shard_id: ShardId = None) -> tuple[int, ...]:
        """Shape of the checkpoint tensor that fills ``shard_id`` of a parameter of ``local_shape``."""
        if self.dim is None:
            return tuple(local_shape)
        part = self._part(shard_id)
        shape = list(local_shape)
        shape[self.dim] = sum(self.full_sizes) if part is None else self.full_sizes[part]
        return tuple(shape)

    def destinations(self, target: torch.Tensor, shard_id: ShardId = None) -> list[Destination]:
        """This rank's boxes of the full HF tensor that fills ``shard_id`` of ``target`` (the
        parameter's data) and the views they land in: one, or one per part for a fused tensor
        loaded whole (``shard_id`` None of a multi-part parameter)."""
        full = self.full_shape(tuple(target.shape), shard_id)
        if self.dim is None:
            return [Destination(Box((0,) * len(full), full), target)]
        part = self._part(shard_id)
        parts = range(len(self.full_sizes)) if part is None else [part]
        out = []
        for i in parts:
            local = self.full_sizes[i] // self.tp_size
            local_offset = sum(size // self.tp_size for size in self.full_sizes[:i])
            lo, hi = [0] * len(full), list(full)
            lo[self.dim] = (0 if part is not None else sum(self.full_sizes[:i])) + self.tp_rank * local
            hi[self.dim] = lo[self.dim] + local
            out.append(Destination(Box(tuple(lo), tuple(hi)), target.narrow(self.dim, local_offset, local)))
        return out

    @torch.no_grad()
    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """The ``weight_loader``: copy this rank's box(es) of the full tensor ``loaded`` into ``param``."""
        expected = self.full_shape(tuple(param.shape), shard_id)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {expected}")
        for dest in self.destinations(param.data, shard_id):
            dest.view.copy_(loaded[tuple(slice(a, b) for a, b in zip(dest.box.lo, dest.box.hi))])


REPLICATED = Sharding(None)


def sharded_param(shape: tuple[int, ...], sharding: Sharding, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Parameter:
    """An uninitialised inference parameter of this rank's ``shape`` that loads itself from
    full checkpoint tensors (``param.weight_loader``; ``param.sharding`` describes the cut)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.sharding = sharding
    param.weight_loader = sharding.load
    return param


def destinations(param: torch.Tensor, shard_id: ShardId = None) -> list[Destination]:
    """``param.sharding.destinations`` (replicated if it has no sharding): [] = not on this rank."""
    return getattr(param, "sharding", REPLICATED).destinations(param.data, shard_id)


def full_shape(param: torch.Tensor, shard_id: ShardId = None) -> tuple[int, ...]:
    """The checkpoint shape that fills ``shard_id`` of ``param`` (replicated if it has no sharding)."""
    return getattr(param, "sharding", REPLICATED).full_shape(tuple(param.shape), shard_id)
