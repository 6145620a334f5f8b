"""The one weight loader: checkpoint loading and every weight update end here.

Every source of weights becomes ``Slab``s: a slab is a box of one full Hugging Face tensor
(``offset``, ``extent`` within ``full_shape``) and, once its data is there, the tensor holding
that box. A full HF tensor is the slab with offset 0; a Megatron-Core TP shard becomes the slabs
its fused layout maps it to (``megatron_layouts.py``: views of the shard, never a full tensor); a
piece of a transfer bucket or of a storage shared over IPC is a slab over that buffer. Each
parameter says which box of which HF tensor this rank keeps (``Sharding.destinations``), and a
load is the copy of every (slab ∩ destination).

Two steps, so that a bad update changes nothing:
  ``WeightPlan.check(slabs)``   metadata only (``tensor`` may be None): names known, full shapes
                                equal, dtypes accepted, no element given twice; then ``verify()``:
                                every touched tensor's part on this rank covered exactly once
                                (``require_all``: every tensor of the model touched).
  ``WeightPlan.program(slabs)`` the copy geometry (destination view, source slice) per slab;
  ``CopyProgram.run``           ``torch._foreach_copy_`` over the pairs (a few multi-tensor launches
                                on a GPU, dtype conversion included) and the elements copied,
                                which ``finish`` compares with the plan (a piece applied twice or
                                skipped fails). ``CopyPlanCache`` keeps plan and program for an
                                update whose metadata repeats (RL refits): one tuple compare.
What a plan asks of the model per piece (name lookups, destinations, where a piece of a given
box meets them) is kept in a ``TargetTable`` (``weight_targets.py``): an engine builds its table
at start, and pieces of equal geometry (every layer) are worked out once.
Streaming loads (a checkpoint read one tensor at a time) check and copy each tensor as it
arrives and verify coverage at the end (``load_stream``).

Extension points (a transform at load such as block quantization builds on these; plain
weights use none of them):
  * Multi-tensor targets: ``model.hf_targets()`` may map several HF names (``X.weight``,
    ``X.weight_scale_inv``, ``k_scale``) to several parameters that one transform reads together;
    ``model.check_weight_names(names)`` (optional) is called with the HF names an update touches
    (a dict: name -> the source dtype of its first piece, None when unknown), after the metadata
    checks, to refuse an incomplete group (a weight without its scales) before anything is
    copied. ``model.optional_hf_name(name)`` (optional): targets a full load does not require
    (scales of weights that may arrive in float and be quantized).
  * A transform per destination: a parameter's ``sharding.destinations`` may return
    ``Destination``s with a ``sink``. A sink receives the pieces instead of a plain copy:
    ``sink.accepts(dtype)`` (plan time: which source dtypes it takes; plain destinations take
    floating-point tensors only), ``sink.write(dst, src, box)`` (``dst`` the part of the
    destination view, ``src`` the matching source piece, ``box`` the piece's box of the full tensor).
  * Staging of pieces that do not cover whole blocks: a sink may buffer what ``write`` gives it;
    ``sink.complete()`` is called once the destination's whole box has arrived in this load or
    update (the plan knows each destination's element count), so a staged buffer is transformed
    then, whatever order and size the pieces came in.
  * Post-load finalize: ``model.finalize_weights(names)`` (optional) runs after a load or an
    update completed, with the HF names it touched (refresh derived tensors in place).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from megatron_async.models.weight_targets import SKIPPED, Chunks, Strided, TargetInfo, TargetTable
from megatron_async.parallel.sharding import Box, BoxSet, Destination


class WeightUpdateError(ValueError):
    """A load or update refused before anything was copied (or, for a piece applied twice or
    skipped after the plan, one whose weights must be replaced)."""


@dataclass(slots=True)
class Slab:
    """Box ``offset`` .. ``offset + extent`` of the full HF tensor ``hf_name`` (``full_shape``);
    ``tensor`` holds exactly that box (None: metadata only). Not frozen: a plan makes one per
    piece, and a frozen dataclass takes 4x as long to build; nothing changes a slab once made."""

    hf_name: str
    offset: tuple[int, ...]
    extent: tuple[int, ...]
    full_shape: tuple[int, ...]
    tensor: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    """The source dtype (the tensor's when given)."""
    origin: tuple[int, ...] | None = None
    """Where the box starts in the tensor the caller gives (a Megatron shard whose slab is a
    view of it; None: at 0, the slab's own tensor): ``CopyProgram`` slices that tensor."""
    chunk: tuple[int, int] | None = None
    """(rows, stride): dim 0 of the box comes in chunks of ``rows`` rows, chunk k from row
    ``origin[0] + k * stride`` of the caller's tensor (a QKV shard's query groups; metadata
    slabs only). None: the box is one block of that tensor."""

    @classmethod
    def full(cls, name: str, tensor: torch.Tensor) -> Slab:
        shape = tuple(tensor.shape)
        return cls(name, (0,) * len(shape), shape, shape, tensor, tensor.dtype)

    @property
    def box(self) -> Box:
        return Box.of(self.offset, self.extent)

    @property
    def source_dtype(self) -> torch.dtype | None:
        return self.tensor.dtype if self.tensor is not None else self.dtype


def name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


class _Target:
    """One HF tensor of the model touched by a plan: the pieces given and the elements of this
    rank's destinations they cover."""

    __slots__ = ("info", "pieces", "dtype", "got")

    def __init__(self, info: TargetInfo):
        self.info, self.pieces, self.got = info, BoxSet(info.full_shape), 0
        self.dtype: torch.dtype | None = None
        """The source dtype of the first piece (None: not given)."""

    @property
    def param(self) -> nn.Parameter:
        return self.info.param

    @property
    def dests(self) -> list[Destination]:
        return self.info.dests

    @property
    def need(self) -> int:
        return self.info.need


class WeightPlan:
    """One load or update of ``model`` (see the module docstring). ``targets`` / ``skip`` /
    ``canonical`` default to the model's ``hf_targets()``, ``skips_hf_name``, ``canonical_name``;
    ``table``: the model's ``TargetTable`` kept from an earlier plan (then those three are its)."""

    def __init__(self, model: nn.Module | None, *, require_all: bool, what: str = "",
                 targets: dict | None = None, skip: Callable[[str], bool] | None = None,
                 canonical: Callable[[str], str] | None = None, table: TargetTable | None = None):
        self.model, self.require_all = model, require_all
        self.what = what or "weight update refused, nothing was changed"
        self.table = table or TargetTable(model, targets, skip, canonical)
        self.targets, self.skip = self.table.targets, self.table.skip
        self.optional = getattr(model, "optional_hf_name", lambda name: False)
        self.touched: dict[str, _Target] = {}
        self.unknown: list[str] = []
        self.misshaped: list[str] = []
        self.refused_dtypes: list[str] = []
        self.overlaps: list[str] = []

    def resolve(self, slab: Slab) -> _Target | None:
        """The touched target of ``slab`` (None: a skipped name); call after ``check``."""
        info = self.table.lookup(slab.hf_name)
        return None if info is SKIPPED else self.touched[info.name]

    def check(self, slabs: Iterable[Slab]) -> None:
        """Record the metadata of ``slabs``; problems are collected (``verify`` raises them)."""
        lookup, piece_of, touched = self.table.lookup, self.table.piece, self.touched
        for slab in slabs:
            info = lookup(slab.hf_name)
            if info is SKIPPED:
                continue
            if info is None:
                self.unknown.append(slab.hf_name)
                continue
            shape = tuple(slab.full_shape)
            if shape != info.full_shape:
                self.misshaped.append(f"'{slab.hf_name}' has shape {shape}, the model expects {info.full_shape}")
                continue
            target = touched.get(info.name)
            if target is None:
                target = touched[info.name] = _Target(info)
            dtype = slab.source_dtype
            if dtype is not None:
                target.dtype = target.dtype or dtype
                if not info.accepts(dtype):
                    self.refused_dtypes.append(f"{slab.hf_name} is {dtype}")
            piece = piece_of(info, tuple(slab.offset), tuple(slab.extent), slab.origin, slab.chunk)
            if piece is None:
                box = slab.box
                self.misshaped.append(f"'{slab.hf_name}' piece {box.lo}..{box.hi} lies outside {slab.full_shape}")
                continue
            if not target.pieces.add(piece.box):
                self.overlaps.append(info.name)
            target.got += piece.elements

    def problems(self, coverage: bool = True) -> list[str]:
        out = []
        for what, items in (("unexpected tensors" if self.require_all else "unknown tensors", self.unknown), ("wrong shapes", self.misshaped),
                            ("refused dtypes", self.refused_dtypes), ("tensors given twice", self.overlaps)):
            if items:
                out.append(f"{what}: {name_list(sorted(set(items)))}")
        if not coverage:
            return out
        incomplete = [f"{name} ({t.got} of {t.need} elements)" for name, t in self.touched.items() if t.got != t.need]
        if incomplete:
            out.append(f"incomplete tensors: {name_list(sorted(incomplete))}")
        if self.require_all:
            missing = sorted(n for n in set(self.targets) - set(self.touched) if not self.optional(n))
            if missing:
                out.append(f"missing tensors: {name_list(missing)}")
        return out

    def verify(self) -> None:
        """Raise ``WeightUpdateError`` naming every problem found so far (coverage included)."""
        found = self.problems()
        if not found:
            check_names = getattr(self.model, "check_weight_names", None)
            if check_names is not None:
                try:
                    check_names({name: t.dtype for name, t in self.touched.items()})
                except ValueError as e:
                    found = [str(e)]
        if found:
            raise WeightUpdateError(f"{self.what}: " + "; ".join(found))

    @property
    def expected(self) -> int:
        """Elements this rank copies when every checked slab is applied once."""
        return sum(t.need for t in self.touched.values())

    def stream(self, weights: Iterable[Slab]) -> int:
        """Check and copy slabs one at a time as they arrive (a checkpoint read tensor by
        tensor: one in host memory at a time); a slab with a problem is not copied. Raises at
        the end, naming every problem (coverage and missing tensors included)."""
        program = CopyProgram([], 0)
        copied = 0
        for slab in weights:
            self.check([slab])
            failed = self.unknown or self.misshaped or self.refused_dtypes or self.overlaps
            if self.table.lookup(slab.hf_name) is SKIPPED or failed:
                continue  # reported at the end; nothing more is copied once the load failed
            program.pairs.append(self._pairs(slab, None))
            copied += program.run([(len(program.pairs) - 1, slab.tensor)])
            program.pairs[-1] = []
        self.verify()
        return copied

    def program(self, slabs: list[Slab], inputs: list[int] | None = None, num_inputs: int = 0) -> CopyProgram:
        """The copy geometry of the checked ``slabs`` (metadata suffices), by input: slab i
        is a box of input ``inputs[i]`` (default i) at ``slab.origin``, so ``CopyProgram.run``
        takes the caller's tensors (a Megatron shard, a bucket's view) as they are; inputs
        without slabs (another rank's copy of a replicated tensor) copy nothing."""
        inputs = list(range(len(slabs))) if inputs is None else inputs
        pairs: list[list[Pair]] = [[] for _ in range(max(max(inputs, default=-1) + 1, num_inputs))]
        for index, slab in zip(inputs, slabs):
            pairs[index] += self._pairs(slab, slab.origin)
        return CopyProgram(pairs, self.expected)

    def _pairs(self, slab: Slab, origin: tuple[int, ...] | None) -> list[Pair]:
        """``origin``: where the box starts in the tensor ``CopyProgram.run`` gets (None: the
        slab's own tensor, at 0; a chunked slab always comes with its origin)."""
        info = self.table.lookup(slab.hf_name)
        if info is SKIPPED:
            return []
        dests = info.dests
        out = []
        for i, both, dst, src in self.table.piece(info, tuple(slab.offset), tuple(slab.extent), origin, slab.chunk).meets:
            view = dests[i].view if dst is None else dests[i].view[dst]
            if type(src) is Chunks:  # the destination rows as (chunk, row, ...), as the source is read
                view = view.view(src.count, src.rows, *view.shape[1:])
            out.append((view, src, dests[i], both))
        return out

    def finish(self, copied: int) -> None:
        """After the copies: the elements copied must be the plan's; then the model's finalize."""
        if copied != self.expected:
            raise WeightUpdateError(f"{copied} elements were copied where the plan expects {self.expected}: "
                                    "a piece was applied twice or skipped; the weights are incomplete")
        finalize = getattr(self.model, "finalize_weights", None)
        if finalize is not None:
            finalize(set(self.touched))


def _add(dense: tuple[list, list], strided: tuple[list, list], dst: torch.Tensor, src: tuple[slice, ...] | Chunks,
         tensor: torch.Tensor | Strided) -> None:
    """One copy of a plain destination: a chunked one (a strided source) apart from the dense ones,
    whose multi-tensor copy on a GPU takes its fast path only where every pair is dense."""
    chunked = type(src) is Chunks
    side = strided if chunked else dense
    side[0].append(dst)
    side[1].append(tensor.piece(src) if type(tensor) is Strided else src.of(tensor) if chunked else tensor[src])


def copy_pairs(*pairs: tuple[list, list]) -> None:
    for dsts, srcs in pairs:
        if dsts:
            torch._foreach_copy_(dsts, srcs)


Pair = tuple[torch.Tensor, tuple[slice, ...] | Chunks, Destination, Box]
"""(destination view piece, the source slices of the slab's tensor (or ``Chunks``: the view is
then (chunk, row, ...)), its destination, the piece's box)."""


class CopyProgram:
    """The pairs of a plan by input index; ``run`` copies the inputs' data through them."""

    def __init__(self, pairs: list[list[Pair]], expected: int):
        self.pairs, self.expected = pairs, expected
        self._arrived: dict[int, int] = {}

    def begin(self) -> None:
        """Forget partly arrived destinations (call at the start of each load or update)."""
        self._arrived.clear()

    def run(self, items: Iterable[tuple[int, torch.Tensor]]) -> int:
        """Copy (input index, that input's tensor) items; returns the elements copied. Sinks get
        their pieces and, once a destination's box is complete, ``complete()``."""
        dense, strided = ([], []), ([], [])
        copied = 0
        with torch.no_grad():
            for index, tensor in items:
                for dst, src, dest, box in self.pairs[index]:
                    copied += dst.numel()
                    if dest.sink is None:
                        _add(dense, strided, dst, src, tensor)
                        continue
                    dest.sink.write(dst, tensor[src], box)
                    done = self._arrived.get(id(dest), 0) + dst.numel()
                    self._arrived[id(dest)] = done
                    if done == dest.box.numel:
                        self._arrived.pop(id(dest))
                        dest.sink.complete()
            copy_pairs(dense, strided)
        return copied

    def bind(self, tensors: list[torch.Tensor | Strided]) -> BoundCopy:
        """The pairs with their sources resolved, for sources that stay where they are (a
        transfer buffer, storages opened over IPC: ``Strided``, each piece made in one view): a
        repeated copy is one multi-tensor copy."""
        dense, strided, rest = ([], []), ([], []), []
        for index, tensor in enumerate(tensors):
            if any(dest.sink is not None for _, _, dest, _ in self.pairs[index]):
                rest.append((index, tensor.tensor() if type(tensor) is Strided else tensor))
                continue
            for dst, src, _, _ in self.pairs[index]:
                _add(dense, strided, dst, src, tensor)
        return BoundCopy(self, dense, strided, rest)


@dataclass
class BoundCopy:
    """``CopyProgram.bind``'s result: ``run()`` copies everything again from the same sources."""

    program: CopyProgram
    dense: tuple[list[torch.Tensor], list[torch.Tensor]]
    """(destinations, sources) of the dense pairs."""
    strided: tuple[list[torch.Tensor], list[torch.Tensor]]
    """The same of the chunked ones (``Chunks``): a multi-tensor copy of their own."""
    with_sinks: list[tuple[int, torch.Tensor]]

    def __post_init__(self):
        self.elements = sum(d.numel() for d in self.dense[0]) + sum(d.numel() for d in self.strided[0])

    def run(self) -> int:
        with torch.no_grad():
            copy_pairs(self.dense, self.strided)
        return self.elements + self.program.run(self.with_sinks)
