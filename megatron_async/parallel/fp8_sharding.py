"""FP8 parameters of a linear (``weight`` e4m3 and ``weight_scale_inv``, the float32 block scales)
that load themselves through the one weight loader (``models/slab_loading.py``) from full Hugging
Face tensors: e4m3 weights with their ``weight_scale_inv`` grid (published FP8 checkpoints, FP8
updates), or float weights quantized on arrival (``quantization="fp8"``, bf16 updates).

Each destination (this rank's box of one full HF tensor: one stacked part, one expert) has an
``Fp8Part`` whose sinks receive the pieces:
- a float weight is staged until its rows, widened to whole 128-row blocks of the full tensor, are
  complete, then quantized on the full tensor's row blocks (columns from this rank's first one):
  where that column starts on a block (TP 1, column-parallel shards, aligned row-parallel ones)
  the bits equal an offline quantization of the full tensor, whatever the TP size;
- an e4m3 weight is copied as it is and its grid rows / columns taken from the checkpoint grid
  (exact); only where this rank's K range starts inside a block (row-parallel shards such as
  768 / 4) is it dequantized with the grid and requantized on the local grid (warned once).
The scale param has one row per 128 weight rows (``scale_block_n`` 128) when every part's rows
start on a block, of the parameter and of the full tensor; else one row per weight row (1):
SmolLM2's q / k / v of 576 / 192 / 192 rows, TP shards inside a block, Mamba's in_proj parts.
Updates write into the same storage (graphs stay valid); a bf16 update of one part (q_proj)
requantizes that part's rows only."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from megatron_async.kernels import fp8_quant as fq
from megatron_async.parallel.sharding import Box, Destination, ShardId

log = logging.getLogger("megatron_async")
G = fq.GROUP
FP8 = torch.float8_e4m3fn
GRID_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
if hasattr(torch, "float8_e8m0fnu"):  # power-of-two ("ue8m0") scales
    GRID_DTYPES.add(torch.float8_e8m0fnu)
_warned: set[int] = set()


@dataclass(eq=False)
class Fp8Part:
    """This rank's share of one full HF tensor of an FP8 linear: weight rows ``s .. s + L`` of the
    parameter (of one expert) hold ``box`` (rows ``o ..``, columns ``k0 ..``) of the full tensor.
    Float weights are received over ``closure`` (``box`` widened to whole 128-row blocks of the
    full tensor), so that they quantize on the full tensor's own grid."""

    layout: Fp8Layout
    expert: int | None
    s: int
    box: Box
    closure: Box
    grid: torch.Tensor
    """Staging of this box's part of the checkpoint grid (float32)."""
    staged: torch.Tensor | None = None
    kind: str = ""
    arrived: set = field(default_factory=set)

    @property
    def rows(self) -> int:
        return self.box.hi[0] - self.box.lo[0]

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this part's weight rows, its scale rows) in the parameters' current storage."""
        lay = self.layout
        w, sc = lay.weight.data, lay.scale.data
        if self.expert is not None:
            w, sc = w[self.expert], sc[self.expert]
        if lay.scale_block_n == G:
            return w[self.s:self.s + self.rows], sc[self.s // G:self.s // G + fq.cdiv(self.rows, G)]
        return w[self.s:self.s + self.rows], sc[self.s:self.s + self.rows]

    def write_weight(self, src: torch.Tensor, box: Box) -> None:
        """A piece (``box`` of the full tensor, within ``closure``)."""
        weight, _ = self.views()
        if src.dtype == FP8:  # as it is; its scales come with the grid (requantized then if K is ragged)
            self.kind = "e4m3"
            mine = box.intersect(self.box)
            if mine is not None:
                weight[_within(mine, self.box)].view(torch.uint8).copy_(src[_within(mine, box)].view(torch.uint8))
            return
        self.kind = "float"
        if box == self.closure:  # the whole closure at once: no staging copy
            self.staged = src.to(weight.device, torch.float32)
            return
        if self.staged is None:
            shape = tuple(b - a for a, b in zip(self.closure.lo, self.closure.hi))
            self.staged = torch.zeros(shape, dtype=torch.float32, device=weight.device)
        self.staged[_within(box, self.closure)] = src

    def weight_complete(self) -> None:
        if self.kind == "float":
            q, grid = fq.quantize_weight(self.staged)  # the closure starts on a block of the full tensor
            self.staged = None
            self.arrived.clear()
            rows = torch.arange(self.rows, device=q.device) + (self.box.lo[0] - self.closure.lo[0])
            self._store(q.index_select(0, rows), grid.index_select(0, rows // G))
            return
        self._arrived("weight")

    def write_grid(self, dst: torch.Tensor, src: torch.Tensor, box: Box) -> None:
        dst.copy_(src.to(torch.float32))

    def _arrived(self, what: str) -> None:
        self.arrived.add(what)
        if self.arrived == {"weight", "grid"}:
            self.arrived.clear()
            self._from_checkpoint_grid()

    def _from_checkpoint_grid(self) -> None:
        weight, _ = self.views()
        o, k0 = self.box.lo
        rows = torch.arange(o, o + self.rows, device=self.grid.device) // G - o // G
        per_row = self.grid.index_select(0, rows)  # [L, local K blocks of the full grid]
        if k0 % G == 0:
            self._store(None, per_row)
            return
        cols = torch.arange(k0, k0 + weight.shape[1], device=self.grid.device) // G - k0 // G
        deq = weight.float() * per_row.index_select(1, cols).to(weight.device)
        if id(self.layout) not in _warned:
            _warned.add(id(self.layout))
            log.warning("FP8 weight shard whose K range starts at %d, inside a 128-column block: requantized on this "
                        "rank's grid (one more e4m3 rounding where checkpoint blocks straddle ranks)", k0)
        q, grid = fq.quantize_weight(deq)
        self._store(q, grid.repeat_interleave(G, dim=0)[:self.rows])

    def _store(self, q: torch.Tensor | None, per_row: torch.Tensor) -> None:
        """Write e4m3 values ``q`` (None: already in place) and their scales, given one row of
        scales per weight row [L, Kb] (each block's rows hold the same)."""
        weight, scale = self.views()
        if q is not None:
            weight.view(torch.uint8).copy_(q.view(torch.uint8))
        per_row = per_row.to(scale.device)
        scale.copy_(per_row[::G] if self.layout.scale_block_n == G else per_row)


def _within(inner: Box, outer: Box) -> tuple[slice, ...]:
    """``inner``'s slices in a tensor holding ``outer`` (``inner`` inside ``outer``)."""
    return tuple(slice(a - lo, b - lo) for a, b, lo in zip(inner.lo, inner.hi, outer.lo))


class _WeightSink:
    def __init__(self, part: Fp8Part):
        self.part = part

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype == FP8 or (dtype.is_floating_point and dtype.itemsize >= 2)

    def write(self, dst, src, box) -> None:
        self.part.write_weight(src, box)

    def complete(self) -> None:
        self.part.weight_complete()


class _GridSink:
    def __init__(self, part: Fp8Part):
        self.part = part

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype in GRID_DTYPES

    def write(self, dst, src, box) -> None:
        self.part.write_grid(dst, src, box)

    def complete(self) -> None:
        self.part._arrived("grid")


class Fp8Layout:
    """The geometry and part states of one FP8 parameter pair; ``inner`` is the weight's plain
    ``Sharding`` or ``ExpertSharding`` (the cut of the full tensors is the bf16 layer's)."""

    def __init__(self, inner, weight_shape: tuple[int, ...], shard_ids: tuple[ShardId, ...], device):
        self.inner = inner
        self.expert = hasattr(inner, "num_experts")
        self.parts: dict[tuple, Fp8Part] = {}
        probe = torch.empty(weight_shape, dtype=FP8, device="meta")
        dests = [(d, self._row_offset(probe, sid, d)) for sid in shard_ids for d in self._inner_dests(probe, sid)]
        rows = weight_shape[-2]
        aligned = all(s % G == 0 and d.box.lo[0] % G == 0 and ((d.box.hi[0] - d.box.lo[0]) % G == 0
                                                              or s + d.box.hi[0] - d.box.lo[0] == rows)
                      for d, s in dests)
        self.scale_block_n = G if aligned else 1
        scale_rows = fq.cdiv(rows, G) if aligned else rows
        scale_shape = (*weight_shape[:-2], scale_rows, fq.cdiv(weight_shape[-1], G))
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=FP8, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32, device=device), requires_grad=False)
        self.weight.sharding, self.scale.sharding = _WeightSharding(self), _ScaleSharding(self)
        self.weight.weight_loader = self.scale.weight_loader = _load_through_sinks
        self.weight.scale_block_n = self.scale_block_n

    def _inner_dests(self, target: torch.Tensor, shard_id: ShardId) -> list[Destination]:
        if self.expert and shard_id is not None and not self.inner.is_local(shard_id[0]):
            return []
        return self.inner.destinations(target, shard_id)

    def _row_offset(self, target: torch.Tensor, shard_id: ShardId, dest: Destination) -> int:
        base = target[shard_id[0] - self.inner.first_expert] if self.expert else target
        return (dest.view.storage_offset() - base.storage_offset()) // base.stride(-2)

    def part(self, target: torch.Tensor, shard_id: ShardId, dest: Destination) -> Fp8Part:
        key = (shard_id, dest.box)
        part = self.parts.get(key)
        if part is None:
            o, k0 = dest.box.lo
            l_rows, k_cols = (b - a for a, b in zip(dest.box.lo, dest.box.hi))
            grid = torch.ones(fq.cdiv(o + l_rows, G) - o // G, fq.cdiv(k0 + k_cols, G) - k0 // G,
                              dtype=torch.float32, device=self.scale.device)
            expert = shard_id[0] - self.inner.first_expert if self.expert else None
            n_full = self.full_shape(shard_id)[0]
            closure = Box((o // G * G, k0), (min(n_full, fq.cdiv(o + l_rows, G) * G), k0 + k_cols))
            part = self.parts[key] = Fp8Part(self, expert, self._row_offset(target, shard_id, dest), dest.box,
                                             closure, grid)
        return part

    def full_shape(self, shard_id: ShardId) -> tuple[int, ...]:
        return self.inner.full_shape(tuple(self.weight.shape), shard_id)


class _WeightSharding:
    def __init__(self, layout: Fp8Layout):
        self.layout = layout

    def full_shape(self, local_shape: tuple[int, ...], shard_id: ShardId = None) -> tuple[int, ...]:
        return self.layout.full_shape(shard_id)

    def destinations(self, target: torch.Tensor, shard_id: ShardId = None) -> list[Destination]:
        """Each part's ``closure`` (its rows widened to whole blocks of the full tensor: the sink
        keeps its own rows and places the pieces itself, so the view is a placeholder there)."""
        lay = self.layout
        out = []
        for d in lay._inner_dests(target, shard_id):
            part = lay.part(target, shard_id, d)
            shape = tuple(b - a for a, b in zip(part.closure.lo, part.closure.hi))
            view = d.view if part.closure == d.box else torch.empty(shape, dtype=FP8, device="meta")
            out.append(Destination(part.closure, view, _WeightSink(part)))
        return out


class _ScaleSharding:
    """The checkpoint grid ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] of each full tensor."""

    def __init__(self, layout: Fp8Layout):
        self.layout = layout

    def full_shape(self, local_shape: tuple[int, ...], shard_id: ShardId = None) -> tuple[int, ...]:
        n, k = self.layout.full_shape(shard_id)
        return fq.cdiv(n, G), fq.cdiv(k, G)

    def destinations(self, target: torch.Tensor, shard_id: ShardId = None) -> list[Destination]:
        lay = self.layout
        out = []
        for d in lay._inner_dests(lay.weight.data, shard_id):
            part = lay.part(lay.weight.data, shard_id, d)
            (o, k0), (hi_r, hi_k) = d.box.lo, d.box.hi
            box = Box((o // G, k0 // G), (fq.cdiv(hi_r, G), fq.cdiv(hi_k, G)))
            out.append(Destination(box, part.grid, _GridSink(part)))
        return out


@torch.no_grad()
def _load_through_sinks(param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """``weight_loader`` of FP8 params: the full tensor ``loaded`` through the destinations' sinks."""
    expected = param.sharding.full_shape(tuple(param.shape), shard_id)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {expected}")
    for dest in param.sharding.destinations(param.data, shard_id):
        dest.sink.write(dest.view, loaded[tuple(slice(a, b) for a, b in zip(dest.box.lo, dest.box.hi))], dest.box)
        dest.sink.complete()


def fp8_params(inner, weight_shape: tuple[int, ...], shard_ids: tuple[ShardId, ...],
               device: torch.device | str) -> tuple[nn.Parameter, nn.Parameter, int]:
    """(weight e4m3, weight_scale_inv float32, scale_block_n) of a linear whose bf16 weight would
    be cut by ``inner`` (``Sharding`` / ``ExpertSharding``). ``shard_ids``: every shard_id the
    weight may be loaded with (its parts, and None for the stacked tensor whole; for experts one
    expert's), which decide where blocks fall."""
    layout = Fp8Layout(inner, weight_shape, shard_ids, device)
    return layout.weight, layout.scale, layout.scale_block_n


def check_fp8_pairs(targets: Callable[[], dict], dtypes: dict) -> None:
    """Refuse, before anything is copied, an e4m3 weight without its ``weight_scale_inv``, a scale
    without its e4m3 weight, or e4m3 for a weight that is not FP8 (``dtypes``: HF name -> source
    dtype of the tensors a load or update touches; ``targets()``: the model's HF targets, asked
    only when an e4m3 tensor came)."""
    problems = []
    if FP8 in dtypes.values():
        targets = targets()
    for name, dtype in dtypes.items():
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            if dtypes.get(weight, None) != FP8:
                problems.append(f"{name} comes without its e4m3 {weight}")
        elif dtype == FP8 and name in targets:
            if targets[name][0].dtype != FP8:
                problems.append(f"{name} is e4m3 but the model keeps that weight in {targets[name][0].dtype}")
            elif name + "_scale_inv" not in dtypes:
                problems.append(f"{name} is e4m3 but comes without {name}_scale_inv")
    if problems:
        raise ValueError("FP8 weights and scales must come in pairs: " + "; ".join(sorted(problems)[:8]))
