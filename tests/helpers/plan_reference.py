"""A weight update's copies and refusals worked out the plain way, to hold the planner to: every
piece against every destination of its tensor (``Box.intersect``), every piece against every
other for overlaps, coverage summed per tensor. No lookups kept, nothing memoised."""
from __future__ import annotations

import torch

from megatron_async.models.megatron_layouts import Shard, megatron_from_hf, megatron_names_of
from megatron_async.models.slab_loading import Slab, WeightPlan, name_list
from megatron_async.parallel.sharding import Box, destinations, full_shape
from megatron_async.weight_transfer import NameMap, owned


def plain(slabs, inputs) -> tuple[list[Slab], list[int]]:
    """``slabs`` with each slab read in chunks (``Slab.chunk``) given as one slab per chunk."""
    out, at = [], []
    for index, slab in zip(inputs, slabs):
        if slab.chunk is None:
            out.append(slab)
            at.append(index)
            continue
        rows, stride = slab.chunk
        for k in range(slab.extent[0] // rows):
            out.append(Slab(slab.hf_name, (slab.offset[0] + k * rows, *slab.offset[1:]), (rows, *slab.extent[1:]),
                            slab.full_shape, None, slab.dtype, (slab.origin[0] + k * stride, *slab.origin[1:])))
            at.append(index)
    return out, at


def reference(model, slabs, inputs, num_inputs: int) -> tuple[list[list[tuple]], list[str]]:
    """(per input, its copies as ``describe`` tuples; the refusals' texts) of ``slabs`` (chunked
    slabs taken chunk by chunk)."""
    slabs, inputs = plain(slabs, inputs)
    targets = model.hf_targets()
    copies: list[list[tuple]] = [[] for _ in range(num_inputs)]
    pieces: dict[str, list[Box]] = {}
    unknown, misshaped, twice = [], [], set()
    for index, slab in zip(inputs, slabs):
        if model.skips_hf_name(slab.hf_name):
            continue
        name = model.canonical_name(slab.hf_name)
        if name not in targets:
            unknown.append(slab.hf_name)
            continue
        param, shard_id = targets[name]
        if tuple(slab.full_shape) != full_shape(param, shard_id):
            misshaped.append(f"'{slab.hf_name}' has shape {tuple(slab.full_shape)}, "
                             f"the model expects {full_shape(param, shard_id)}")
            continue
        box = Box.of(slab.offset, slab.extent)
        if any(b.intersect(box) is not None for b in pieces.get(name, [])):
            twice.add(name)
        pieces.setdefault(name, []).append(box)
        base = [o - g for o, g in zip(slab.offset, slab.origin or (0,) * len(slab.offset))]
        for i, dest in enumerate(destinations(param, shard_id)):
            both = dest.box.intersect(box)
            if both is not None:
                dst = dest.view[tuple(slice(a - lo, b - lo) for a, b, lo in zip(both.lo, both.hi, dest.box.lo))]
                src = tuple(slice(a - o, b - o) for a, b, o in zip(both.lo, both.hi, base))
                copies[index].append(describe(name, i, dst, src, both))
    problems = [f"unknown tensors: {name_list(sorted(set(unknown)))}"] if unknown else []
    problems += [f"wrong shapes: {name_list(sorted(set(misshaped)))}"] if misshaped else []
    problems += [f"tensors given twice: {name_list(sorted(twice))}"] if twice else []
    incomplete = []
    for name, boxes in pieces.items():
        dests = destinations(*targets[name])
        got = sum(d.box.intersect(b).numel for d in dests for b in boxes if d.box.intersect(b) is not None)
        need = sum(d.box.numel for d in dests)
        if got != need:
            incomplete.append(f"{name} ({got} of {need} elements)")
    problems += [f"incomplete tensors: {name_list(sorted(incomplete))}"] if incomplete else []
    return copies, problems


def describe(name: str, dest_index: int, dst: torch.Tensor, src: tuple[slice, ...], both: Box) -> tuple:
    """One copy: its tensor and destination, where the destination view lies (address on a real
    device, storage offset, shape, strides), the source slices and the box."""
    address = dst.data_ptr() if dst.device.type != "meta" else None
    where = (address, dst.storage_offset(), tuple(dst.shape), dst.stride())
    return (name, dest_index, where, tuple((s.start, s.stop, s.step) for s in src), both)


def planned(plan: WeightPlan, program) -> list[list[tuple]]:
    """``program``'s copies as ``describe`` tuples (a copy in chunks as one per chunk)."""
    from megatron_async.models.weight_targets import Chunks  # here: `refit-plan --against` loads this file with an older tree
    names = {id(d): (name, i) for name, t in plan.touched.items() for i, d in enumerate(t.dests)}
    out = []
    for pairs in program.pairs:
        out.append([])
        for dst, src, dest, both in pairs:
            if not isinstance(src, Chunks):
                out[-1].append(describe(*names[id(dest)], dst, src, both))
                continue
            assert dst.shape[:2] == (src.count, src.rows)
            for k in range(src.count):
                lo = (both.lo[0] + k * src.rows, *both.lo[1:])
                box = Box(lo, (lo[0] + src.rows, *both.hi[1:]))
                out[-1].append(describe(*names[id(dest)], dst[k], src.slices(k), box))
    return out


def trainer_metas(model, shards: list[Shard]) -> list[tuple]:
    """(Megatron name, shape, dtype, Shard) of every tensor the trainer ranks ``shards`` send to
    ``model`` (its own copy of each replicated tensor dropped), from metadata (meta tensors)."""
    names, dims = NameMap.for_arch(model.spec.name), model.megatron_dims()
    hf = {n: torch.empty(s, device="meta") for n, s in model.hf_shapes().items()}
    metas = []
    for shard in shards:
        tensors = megatron_from_hf(names, dims, hf, megatron_names_of(names, hf, dims, shard), shard)
        metas += [(n, tuple(t.shape), torch.bfloat16, s) for n, t, s in
                  owned([(n, t, shard) for n, t in tensors.items()], model.spec.name)]
    return metas
