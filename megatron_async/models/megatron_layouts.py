"""Megatron-Core tensors -> slabs of Hugging Face tensors, by the rules of ``megatron_tables.py``.

Nothing here builds a full tensor: ``megatron_slabs`` turns one (name, tensor, ``Shard``) into
``Slab``s, views of the shard that each say which box of which full HF tensor they fill; the slab
loader copies the part of each that its rank keeps. Conversion is two row maps composed by
interval intersection: shard-local rows -(``Split``)-> full Megatron rows -(``Layout``)-> (HF
part, row). TP shards of any size, pipeline stages (``Shard.layer_offset``), expert-parallel
ranks and a padded vocabulary all reduce to this. ``megatron_from_hf`` is the reverse (a trainer
rank's shard from full HF tensors: tests, the refit example).

Conventions: a tensor several trainer ranks hold identically (TP-replicated norms; non-expert
tensors on every EP rank) is taken only from rank 0 of those ranks (``owns``), so every element
arrives exactly once; expert indices in names are local to the EP rank (global = ep_rank *
experts / ep_size + local); ``_extra_state`` entries carry no weights and are skipped."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from megatron_async.models.megatron_tables import IGNORED_SUFFIXES, MEGATRON_PREFIXES, RULES, Layout, Rule, Split
from megatron_async.models.slab_loading import Slab, WeightUpdateError


class UnknownTensorError(WeightUpdateError):
    """A Megatron-Core name no rule of the architecture accepts."""


@dataclass(frozen=True)
class Dims:
    """The full (unsharded) sizes the layouts need (``DecoderModel.megatron_dims``)."""

    vocab: int
    hidden: int
    heads: int = 0
    groups: int = 0
    """Query groups = key/value heads."""
    head_dim: int = 0
    ffn: int = 0
    moe_ffn: int = 0
    experts: int = 0
    shared_ffn: int = 0
    mamba_inner: int = 0
    """Mamba heads * head_dim."""
    mamba_bc: int = 0
    """Mamba n_groups * d_state (the size of B and of C)."""
    mamba_heads: int = 0


@dataclass(frozen=True)
class Shard:
    """Where a trainer's tensor sits in the full model (defaults: a full, unsharded tensor)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    """Expert tensor-parallel rank / size (Megatron's ``expert_tensor_parallel_size``); None = TP's."""
    etp_size: int | None = None
    layer_offset: int = 0
    """Global number of this pipeline stage's first layer (Megatron names are stage-local)."""

    def __post_init__(self):
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep"),
                                 (self.etp_rank or 0, self.etp_size or 1, "etp")):
            if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
                raise WeightUpdateError(f"shard {what}_rank {rank!r} is not in [0, {what}_size {size!r})")
        if not isinstance(self.layer_offset, int) or self.layer_offset < 0:
            raise WeightUpdateError(f"shard layer_offset must be an int >= 0, got {self.layer_offset!r}")

    def expert_tp(self) -> tuple[int, int]:
        if self.etp_size is None:
            return self.tp_rank, self.tp_size
        return self.etp_rank or 0, self.etp_size


_FIELD = {"layer": r"(?P<layer>\d+)", "expert": r"(?P<expert>\d+)"}
_NUMBER = {"layer": r"(\d+)", "expert": r"(\d+)"}


def _regex(pattern: str, fields: dict[str, str] = _FIELD) -> str:
    out, pos = "", 0
    for m in re.finditer(r"\{(layer|expert)\}", pattern):
        out += re.escape(pattern[pos:m.start()]) + fields[m.group(1)]
        pos = m.end()
    return out + re.escape(pattern[pos:]) + r"\Z"


class NameMap:
    """The compiled rules of one architecture: every spelling of every rule as one alternative of
    one regex, tried in the rules' order (the first that matches names the rule), so a name is
    matched by one scan in C instead of one Python call per spelling."""

    _cache: dict[str, NameMap] = {}

    def __init__(self, arch: str):
        if arch not in RULES:
            raise WeightUpdateError(f"no Megatron-Core name table for {arch!r} (have {', '.join(sorted(RULES))})")
        self.arch = arch
        self.rules = RULES[arch]
        alternatives, self._found, group = [], {}, 1
        for rule in self.rules:
            for pattern in rule.megatron:
                fields = re.findall(r"\{(layer|expert)\}", pattern)
                self._found[group] = (rule, [(f, group + 1 + i) for i, f in enumerate(fields)])
                alternatives.append(f"({_regex(pattern, _NUMBER)})")
                group += 1 + len(fields)
        self._regex = re.compile("|".join(alternatives))

    @classmethod
    def for_arch(cls, arch: str) -> NameMap:
        if arch not in cls._cache:
            cls._cache[arch] = cls(arch)
        return cls._cache[arch]

    def match(self, name: str) -> tuple[Rule, dict[str, int]] | None:
        m = self._regex.match(name)
        if m is None:
            return None
        rule, fields = self._found[m.lastindex]
        return rule, {f: int(m.group(g)) for f, g in fields}


@dataclass(frozen=True)
class _Run:
    """Rows [src, src+n) of one coordinate space map to rows [dst, dst+n) of part ``part``."""

    src: int
    n: int
    part: int
    dst: int


def _layout_runs(rule: Rule, dims: Dims, rows: int) -> list[_Run]:
    """FULL Megatron rows -> (HF part, row) runs, in Megatron row order."""
    if rule.layout == Layout.SAME:
        return [_Run(0, rows, 0, 0)]
    if rule.layout == Layout.GATE_UP:
        half = rows // 2
        return [_Run(0, half, 0, 0), _Run(half, half, 1, 0)]
    d, g = dims.head_dim, dims.groups
    q = dims.heads // g * d
    per_group = q + 2 * d
    if rows != g * per_group:
        raise WeightUpdateError(f"linear_qkv has {rows} rows, the model has {g} query groups of {per_group}")
    runs = []
    for i in range(g):
        base = i * per_group
        runs += [_Run(base, q, 0, i * q), _Run(base + q, d, 1, i * d), _Run(base + q + d, d, 2, i * d)]
    return runs


def _shard_runs(rule: Rule, dims: Dims, local_rows: int, rank: int, size: int) -> list[_Run]:
    """A shard's LOCAL rows (along the split dim) -> FULL Megatron rows."""
    if rule.split != Split.COLUMN_PARTS:  # REPLICATED (rank 0 of 1) / COLUMN / ROW / VOCAB: contiguous
        return [_Run(0, local_rows, 0, rank * local_rows)]
    runs, local, full = [], 0, 0
    for s in (getattr(dims, p) for p in rule.parts):
        if s % size:
            raise WeightUpdateError(f"a part of {s} rows does not split over {size} ranks")
        n = s // size
        runs.append(_Run(local, n, 0, full + rank * n))
        local, full = local + n, full + s
    if local != local_rows:
        raise WeightUpdateError(f"a shard of {local_rows} rows, where parts {rule.parts} over {size} ranks give {local}")
    return runs


def _compose(a: list[_Run], b: list[_Run]) -> list[_Run]:
    """a: local -> full; b: full -> (part, row). Result: local -> (part, row)."""
    out = []
    for ra in a:
        for rb in b:
            lo, hi = max(ra.dst, rb.src), min(ra.dst + ra.n, rb.src + rb.n)
            if lo < hi:
                out.append(_Run(ra.src + lo - ra.dst, hi - lo, rb.part, rb.dst + lo - rb.src))
    return out


def _part_rows(rule: Rule, dims: Dims, full_rows: int) -> list[int]:
    if rule.split == Split.VOCAB:
        return [dims.vocab]
    if rule.layout == Layout.QKV:
        return [dims.heads * dims.head_dim, dims.groups * dims.head_dim, dims.groups * dims.head_dim]
    if rule.layout == Layout.GATE_UP:
        return [full_rows // 2] * 2
    return [full_rows]


def owns(rule: Rule, shard: Shard) -> bool:
    """Whether this trainer rank's copy of a tensor is the one used (see the module docstring)."""
    if rule.expert:
        return rule.split != Split.REPLICATED or shard.expert_tp()[0] == 0
    return shard.ep_rank == 0 and (rule.split != Split.REPLICATED or shard.tp_rank == 0)


def _resolve(names: NameMap, dims: Dims, name: str, shard: Shard) -> tuple[Rule, int | None, int | None, int, int]:
    """(rule, global layer, global expert, split rank, split size) of a Megatron tensor name."""
    found = names.match(name)
    if found is None:
        raise UnknownTensorError(f"unknown Megatron-Core tensor {name!r} for {names.arch}")
    rule, fields = found
    layer = fields.get("layer")
    layer = None if layer is None else layer + shard.layer_offset
    expert = fields.get("expert")
    rank, size = shard.tp_rank, shard.tp_size
    if rule.expert:
        if not dims.experts or dims.experts % shard.ep_size:
            raise WeightUpdateError(f"{name}: {dims.experts} experts do not split over ep_size {shard.ep_size}")
        local = dims.experts // shard.ep_size
        if not 0 <= expert < local:
            raise WeightUpdateError(f"{name}: local expert {expert} outside [0, {local})")
        expert += shard.ep_rank * local
        rank, size = shard.expert_tp()
    if rule.split == Split.REPLICATED:
        rank, size = 0, 1
    return rule, layer, expert, rank, size


def megatron_slabs(names: NameMap, dims: Dims, name: str, shape: tuple[int, ...], tensor: torch.Tensor | None = None,
                   shard: Shard = Shard(), rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> list[Slab]:
    """The slabs one Megatron tensor (a TP / EP / PP shard, or the full tensor) fills: [] for
    ``_extra_state`` and for a copy another rank sends (``owns``). ``tensor`` None: metadata
    only. ``rows``: ``tensor`` holds only rows [start, stop) of dim 0 of the shard of ``shape``
    (a tensor sent in pieces so that no transfer bucket exceeds its size)."""
    if name.endswith(IGNORED_SUFFIXES):
        return []
    rule, layer, expert, rank, size = _resolve(names, dims, name, shard)
    if not owns(rule, shard):
        return []
    key = (rule, dims, tuple(shape), rank, size, None if rows is None else tuple(rows))
    found = _BOXES.get(key)
    if found is None:
        boxes = _slab_boxes(rule, dims, name, *key[2:])
        found = (boxes, _chunked(boxes))
        if len(_BOXES) > 4096:  # geometries of the shapes seen; an update's layers share them
            _BOXES.clear()
        _BOXES[key] = found
    hf = [p.format(layer=layer, expert=expert) for p in rule.hf]
    if tensor is None:
        return [Slab(hf[part], offset, extent, full_shape, None, dtype, origin, chunk)
                for part, offset, extent, full_shape, origin, chunk in found[1]]
    return [Slab(hf[part], offset, extent, full_shape, tensor.narrow(dim, src, n), tensor.dtype, origin)
            for part, offset, extent, full_shape, origin, dim, src, n in found[0]]


_BOXES: dict[tuple, tuple[list[tuple], list[tuple]]] = {}
"""(rule, dims, shape, split rank, split size, rows) -> ``_slab_boxes`` and ``_chunked`` of them:
the same for every layer."""


def _chunked(boxes: list[tuple]) -> list[tuple]:
    """(HF part, offset, extent, full shape, origin, chunk) of metadata slabs: boxes of one part
    that lie back to back along dim 0 of the HF tensor and at one stride in the shard (the query
    groups of a QKV tensor: q of every group, then k, then v) become one slab read in chunks
    (``Slab.chunk``), so a plan and its copy handle one piece where it had one per group."""
    groups: list[list] = []
    last: dict[int, list] = {}
    for part, offset, extent, full_shape, origin, dim, src, n in boxes:
        g = last.get(part)
        if g is not None and dim == 0 == g[0][5] and n == g[0][7] and offset[0] == g[0][1][0] + g[1] * n \
                and offset[1:] == g[0][1][1:] and extent[1:] == g[0][2][1:] and origin[1:] == g[0][4][1:] \
                and src - g[0][6] >= g[1] * n and (g[1] == 1 or src - g[0][6] == g[1] * g[2]):
            g[2] = src - g[0][6] if g[1] == 1 else g[2]
            g[1] += 1
            continue
        g = last[part] = [(part, offset, extent, full_shape, origin, dim, src, n), 1, 0]
        groups.append(g)
    out = []
    for (part, offset, extent, full_shape, origin, _, _, n), count, stride in groups:
        if count > 1:
            extent = (count * n, *extent[1:])
        out.append((part, offset, extent, full_shape, origin, (n, stride) if count > 1 and stride != n else None))
    return out


def _slab_boxes(rule: Rule, dims: Dims, name: str, shape: tuple[int, ...], rank: int, size: int,
                rows: tuple[int, int] | None) -> list[tuple]:
    """(HF part, offset, extent, full shape, origin, split dim, first row, rows) of each slab."""
    dim = 1 if rule.split == Split.ROW else 0
    if len(shape) <= dim:
        raise WeightUpdateError(f"{name}: a tensor of shape {shape} has no dim {dim} to split")
    local_rows = shape[dim]
    full_rows = sum(getattr(dims, p) for p in rule.parts) if rule.split == Split.COLUMN_PARTS else local_rows * size
    runs = _shard_runs(rule, dims, local_rows, rank, size)
    if dim == 0:
        runs = _compose(runs, _layout_runs(rule, dims, full_rows))
    part_rows = _part_rows(rule, dims, full_rows)
    if rule.split == Split.VOCAB:  # drop the padding rows beyond the HF vocabulary
        runs = [_Run(r.src, min(r.n, dims.vocab - r.dst), r.part, r.dst) for r in runs if r.dst < dims.vocab]
    if rows is not None and dim == 0:
        runs = [_Run(lo - rows[0], hi - lo, r.part, r.dst + lo - r.src) for r in runs
                if (lo := max(r.src, rows[0])) < (hi := min(r.src + r.n, rows[1]))]
    out = []
    for r in runs:
        full_shape, offset, extent = list(shape), [0] * len(shape), list(shape)
        full_shape[dim], offset[dim], extent[dim] = part_rows[r.part], r.dst, r.n
        if rows is not None and dim != 0:  # a piece of a row-parallel / replicated tensor
            offset[0], extent[0] = rows[0], rows[1] - rows[0]
        origin = [0] * len(shape)
        origin[dim] = r.src
        out.append((r.part, tuple(offset), tuple(extent), tuple(full_shape), tuple(origin), dim, r.src, r.n))
    return out


def detect_format(names: Iterable[str]) -> str:
    """"megatron" or "hf" from the names of an update; a mix is an error."""
    kinds = {"megatron" if n.startswith(MEGATRON_PREFIXES) else "hf" for n in names}
    if len(kinds) > 1:
        raise WeightUpdateError("an update mixes Megatron-Core and Hugging Face names: pass weights_format")
    return kinds.pop() if kinds else "hf"


def _assemble(rule: Rule, dims: Dims, parts: list[torch.Tensor]) -> torch.Tensor:
    if rule.layout == Layout.SAME:
        return parts[0]
    if rule.layout == Layout.GATE_UP:
        return torch.cat(parts, dim=0)
    q, k, v = (p.reshape(dims.groups, -1, *p.shape[1:]) for p in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])


def megatron_from_hf(names: NameMap, dims: Dims, hf: Mapping[str, torch.Tensor], megatron_names: Iterable[str],
                     shard: Shard = Shard(), padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """The Megatron tensors ``megatron_names`` of one trainer rank, built from full HF tensors
    (padding vocabulary rows are zeros). Every rank's copy of a replicated tensor is returned."""
    out = {}
    for name in megatron_names:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        rule, layer, expert, rank, size = _resolve(names, dims, name, shard)
        full = _assemble(rule, dims, [hf[p.format(layer=layer, expert=expert)] for p in rule.hf])
        if rule.split == Split.VOCAB and padded_vocab:
            full = torch.cat([full, full.new_zeros((padded_vocab - full.shape[0], *full.shape[1:]))])
        if rule.split == Split.COLUMN_PARTS:
            chunks = full.split([getattr(dims, p) for p in rule.parts], dim=0)
            out[name] = torch.cat([c.chunk(size, dim=0)[rank] for c in chunks]).contiguous()
        else:
            out[name] = full.chunk(size, dim=1 if rule.split == Split.ROW else 0)[rank].contiguous()
    return out


def megatron_shapes(names: NameMap, dims: Dims, hf_shapes: Mapping[str, tuple], megatron_names: Iterable[str],
                     shard: Shard = Shard()) -> dict[str, tuple[int, ...]]:
    """The shapes of ``megatron_from_hf``'s tensors (no padded vocabulary) from the HF shapes
    alone: no tensor is built (meta tensors would load torch's reference ops at first use)."""
    out = {}
    for name in megatron_names:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        rule, layer, expert, rank, size = _resolve(names, dims, name, shard)
        parts = [hf_shapes[p.format(layer=layer, expert=expert)] for p in rule.hf]
        shape = list(parts[0]) if rule.layout == Layout.SAME else [sum(p[0] for p in parts), *parts[0][1:]]
        lengths = [getattr(dims, p) for p in rule.parts] if rule.split == Split.COLUMN_PARTS else \
            [shape[1 if rule.split == Split.ROW else 0]]
        piece = sum(max(0, min(-(-n // size), n - rank * -(-n // size))) for n in lengths)  # (torch.chunk's)
        shape[1 if rule.split == Split.ROW else 0] = piece
        out[name] = tuple(shape)
    return out


def megatron_names_of(names: NameMap, hf_names: Iterable[str], dims: Dims, shard: Shard = Shard(),
                      num_layers: int | None = None) -> list[str]:
    """The Megatron-Core names (each rule's first spelling) a trainer rank at ``shard`` holds for a
    model of ``hf_names`` (its ``hf_targets()``): its EP rank's experts, numbered locally, and
    with ``num_layers`` its pipeline stage's layers [layer_offset, layer_offset + num_layers),
    numbered from 0. The trainer side of tests and the refit example."""
    compiled = [(re.compile(_regex(p)), rule) for rule in names.rules for p in rule.hf]
    local = dims.experts // shard.ep_size if dims.experts else 0
    out: dict[str, None] = {}
    for hf in hf_names:
        for regex, rule in compiled:
            m = regex.match(hf)
            if m is None:
                continue
            fields = {k: int(v) for k, v in m.groupdict().items()}
            layer, expert = fields.get("layer"), fields.get("expert")
            if layer is not None:
                layer -= shard.layer_offset
                if layer < 0 or (num_layers is not None and layer >= num_layers):
                    break
            if expert is not None:
                if expert // local != shard.ep_rank:
                    break
                expert %= local
            out[rule.megatron[0].format(layer=layer, expert=expert)] = None
            break
    return list(out)
