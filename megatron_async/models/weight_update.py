"""Weights updated in place: an RL trainer's tensors under Hugging Face names (full tensors) or
Megatron-Core names (its fused layouts, whole or as TP / EP / PP shards), or a checkpoint
directory; all through the one slab loader (``slab_loading.py``), as loading is.

Everything is checked before anything is copied (names, shapes, dtypes, pieces given twice,
coverage of this rank's part of each touched tensor; a checkpoint's from its safetensors
headers), so a bad update changes nothing. Values are copied into the existing parameter
storage: device addresses stay, and captured CUDA graphs replay the new values. A
``CopyPlanCache`` keeps the checked plan and its copy program for updates whose metadata repeats
(the same names, shapes, dtypes and shards each RL step): such an update costs a key compare and
one multi-tensor copy."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from megatron_async.models.checkpoint import safetensors_files
from megatron_async.models.megatron_layouts import (NameMap, Shard, UnknownTensorError, detect_format, megatron_names_of,
                                                    megatron_shapes, megatron_slabs)
from megatron_async.models.slab_loading import CopyProgram, Slab, WeightPlan, WeightUpdateError, name_list
from megatron_async.models.weight_targets import TargetTable

__all__ = ["CopyPlanCache", "WeightUpdateError", "plan_update", "update_weights_in_place", "weight_slabs"]

FORMATS = ("hf", "megatron")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors dtype names -> torch's; any other (integers) reads as uint8: not a weight."""


def _checkpoint_headers(path: Path) -> Iterator[tuple[Slab, tuple[Path, str]]]:
    """A metadata slab of every tensor, with (file, stored name), read from the headers only."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    dtype = getattr(torch, _ST_DTYPES.get(sl.get_dtype(), "uint8"))
                    yield Slab(name, (0,) * len(shape), shape, shape, None, dtype), (file, name)
        except SafetensorError as e:
            raise WeightUpdateError(f"{file} is not a readable safetensors file: {e}") from e


def _normalise(weights) -> list[tuple]:
    """(name, tensor) pairs / (name, tensor, Shard) triples / a mapping -> a list of tuples."""
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for item in items:
        if not (isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor) and (len(item) == 2 or isinstance(item[2], Shard))):
            got = tuple(type(x).__name__ for x in item) if isinstance(item, tuple) else type(item).__name__
            raise WeightUpdateError(f"weights must be (name, tensor) pairs or (name, tensor, Shard) triples, got {got}")
    return items


def weight_slabs(model: nn.Module, metas: Iterable[tuple], weights_format: str | None) -> tuple[list[Slab], list[int]]:
    """Metadata slabs of (name, shape, dtype[, Shard[, rows]]) inputs and the input index of each
    slab: an HF name gives one full slab (or the rows [start, stop) of dim 0 a piece holds), a
    Megatron-Core name the slabs of its layout and shard."""
    metas = [(*m, None, None)[:5] for m in metas]
    fmt = weights_format or detect_format(m[0] for m in metas)
    if fmt not in FORMATS:
        raise WeightUpdateError(f"weights_format must be one of {FORMATS} or None, got {weights_format!r}")
    slabs, inputs = [], []
    names = dims = None
    if fmt == "megatron":
        names, dims = NameMap.for_arch(model.spec.name), model.megatron_dims()
    unknown = []
    for i, (name, shape, dtype, shard, rows) in enumerate(metas):
        shape = tuple(shape)
        if fmt == "megatron":
            try:
                found = megatron_slabs(names, dims, name, shape, None, shard or Shard(), rows, dtype)
            except UnknownTensorError:
                unknown.append(name)
                continue
        elif shard is not None and shard != Shard():
            raise WeightUpdateError(f"{name}: shards are given with Megatron-Core names (weights_format='megatron')")
        elif rows is not None:
            found = [Slab(name, (rows[0], *[0] * (len(shape) - 1)), (rows[1] - rows[0], *shape[1:]), shape, None, dtype,
                          (0,) * len(shape))]
        else:
            found = [Slab(name, (0,) * len(shape), shape, shape, None, dtype)]
        slabs += found
        inputs += [i] * len(found)
    if unknown:
        raise WeightUpdateError(f"weight update refused, nothing was changed: unknown Megatron-Core tensors for "
                                f"{names.arch}: {name_list(sorted(set(unknown)))}")
    return slabs, inputs


class CopyPlanCache:
    """The checked plans and copy programs of the last few updates, keyed by their metadata
    (names, shapes, dtypes, shards), and the model's ``TargetTable`` (``table``: built once, at
    engine start). An entry holds views of the parameters: it is used only while every parameter
    it touches still has the same storage.

    A plan depends on the metadata alone, in any order: each one is also kept under its metas
    sorted by name, so an update whose key is new (an IPC payload over other storages) but whose
    tensors were planned before, or ahead (``prepare``), takes that plan with its program's
    inputs put in the update's order."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[WeightPlan, CopyProgram, tuple]] = OrderedDict()
        self._table: TargetTable | None = None
        self._last: tuple | None = None  # (the key object of the last hit, its entry)
        self.hits = self.misses = 0
        self.reused = 0
        """Updates of a new key that took the plan of the same metadata (``prepare`` included)."""

    def table(self, model: nn.Module) -> TargetTable:
        """``model``'s lookups, kept while its parameters stay where they are."""
        if self._table is None or self._table.model is not model or not self._table.valid():
            self._table = TargetTable(model).warm()
        return self._table

    def _valid(self, key: tuple):
        last = self._last  # the last key object again: found without hashing its every entry
        entry = last[1] if last is not None and last[0] is key else self._entries.get(key)
        return entry if entry is not None and all(p.data_ptr() == ptr for p, ptr in entry[2]) else None

    def _keep(self, key: tuple, entry: tuple) -> None:
        self._last = None  # the next hit takes its place at the end again (and no evicted entry stays held)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, model: nn.Module, key: tuple, metas, weights_format: str | None) -> tuple[WeightPlan, CopyProgram]:
        """The (plan, program) of ``key``: on a miss ``plan_update`` of ``metas`` (or of
        ``metas()``, a callable), which raises ``WeightUpdateError`` for a bad update (not cached)."""
        entry = self._valid(key)
        if entry is not None:
            if self._last is None or self._last[0] is not key:
                self._entries.move_to_end(key)
                self._last = (key, entry)
            self.hits += 1
            return entry[0], entry[1]
        metas = list(metas() if callable(metas) else metas)
        order = sorted(range(len(metas)), key=lambda i: metas[i][0])
        by_name = ("by_name", weights_format, tuple(metas[i] for i in order))
        entry = self._valid(by_name)
        if entry is None:
            self.misses += 1
            plan, program = plan_update(model, list(by_name[2]), weights_format, self.table(model))
            params = {id(t.param): t.param for t in plan.touched.values()}.values()
            entry = (plan, program, tuple((p, p.data_ptr()) for p in params))
            self._keep(by_name, entry)
        else:
            self.reused += 1
        program = entry[1]
        if order != list(range(len(order))):
            pairs = [None] * len(order)
            for j, i in enumerate(order):
                pairs[i] = program.pairs[j]
            program = CopyProgram(pairs, program.expected)
        self._keep(key, (entry[0], program, entry[2]))
        return entry[0], program

    def prepare(self, model: nn.Module, metas: list[tuple], weights_format: str) -> None:
        """Plan ``metas`` now (at engine start), so the first update of that metadata takes it
        (not counted: ``misses`` counts the plans updates made)."""
        misses = self.misses
        self.get(model, ("prepared", weights_format), metas, weights_format)
        self.misses = misses


def megatron_metas(model: nn.Module, shard: Shard, dtype: torch.dtype) -> list[tuple]:
    """(Megatron-Core name, shape, ``dtype``, ``shard``) of every tensor a trainer rank at ``shard``
    holds for ``model`` (its layout's first spelling of each name), from metadata only."""
    names, dims, hf = NameMap.for_arch(model.spec.name), model.megatron_dims(), model.hf_shapes()
    shapes = megatron_shapes(names, dims, hf, megatron_names_of(names, hf, dims, shard), shard)
    return [(n, shape, dtype, shard) for n, shape in shapes.items()]


def plan_update(model: nn.Module, metas: list[tuple], weights_format: str | None,
                table: TargetTable | None = None) -> tuple[WeightPlan, CopyProgram]:
    """The checked plan and copy program of an update of (name, shape, dtype[, Shard[, rows]])
    ``metas`` (input i = ``metas[i]``); ``WeightUpdateError`` (nothing copied) for a bad one."""
    slabs, inputs = weight_slabs(model, metas, weights_format)
    plan = WeightPlan(model, require_all=False, table=table)
    plan.check(slabs)
    plan.verify()
    return plan, plan.program(slabs, inputs, len(metas))


@torch.no_grad()
def update_weights_in_place(model: nn.Module, weights, *, weights_format: str | None = None,
                            cache: CopyPlanCache | None = None) -> int:
    """Copy ``weights`` into ``model``'s parameters, each rank keeping its part: (HF name, full
    tensor) pairs, (Megatron-Core name, tensor[, Shard]) tuples (a trainer rank's shards; every
    element of a touched tensor must arrive once, from this call), a mapping, or a checkpoint
    directory. ``weights_format``: "hf", "megatron" or None (detected from the names). Any subset
    of the model's tensors. Returns the number of HF tensors updated; raises
    ``WeightUpdateError`` (and copies nothing) on an unknown name, a wrong shape, a piece given
    twice, an incomplete tensor or a non-floating tensor."""
    if isinstance(weights, (str, Path)):
        return _update_from_checkpoint(model, Path(weights))
    items = _normalise(weights)
    metas = [(item[0], tuple(item[1].shape), item[1].dtype, *item[2:]) for item in items]
    if cache is None:
        plan, program = plan_update(model, metas, weights_format)
    else:
        plan, program = cache.get(model, (weights_format, tuple(metas)), metas, weights_format)
    program.begin()
    copied = program.run((i, item[1]) for i, item in enumerate(items))
    plan.finish(copied)
    return len(plan.touched)


def _update_from_checkpoint(model: nn.Module, path: Path) -> int:
    try:
        headers = list(_checkpoint_headers(path))
    except ValueError as e:
        raise WeightUpdateError(str(e)) from None
    plan = WeightPlan(model, require_all=False)
    plan.check(slab for slab, _ in headers)
    plan.verify()
    by_file: dict[Path, list[tuple[Slab, str]]] = {}
    for slab, (file, stored) in headers:
        if plan.resolve(slab) is not None:
            by_file.setdefault(file, []).append((slab, stored))
    copied = 0
    for file, entries in by_file.items():  # one tensor in host memory at a time
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for slab, stored in entries:
                copied += plan.program([slab]).run([(0, f.get_tensor(stored))])
    plan.finish(copied)
    return len(plan.touched)
