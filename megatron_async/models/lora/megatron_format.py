"""Reading a LoRA adapter in Megatron-Core's naming (the ``LoRA`` and ``CanonicalLoRA`` adapters of
NeMo and Megatron-Bridge) into the same full (A, B) pairs per Hugging Face module as PEFT's format,
so that the one checked path of ``adapters.py`` writes either.

Names: ``<linear>.adapter.linear_in.weight`` (A [dim, in]) and ``<linear>.adapter.linear_out.weight``
(B [out, dim]) of a wrapped ``<linear>`` (``decoder.layers.N.self_attention.linear_qkv`` /
``linear_proj``, ``decoder.layers.N.mlp.linear_fc1`` / ``linear_fc2``), or, in the canonical form,
one adapter per stacked projection: ``linear_qkv.adapter.adapter_{q,k,v}.linear_{in,out}.weight``,
``linear_fc1.adapter.adapter_{gate,up}.linear_{in,out}.weight``. Wrappers' ``module.`` prefixes are
dropped. The scale is Megatron's ``alpha / dim`` (config dict ``{"dim", "alpha"}``, or PEFT's
``r`` / ``lora_alpha``; none: 1).

Layouts: the fused form's B has its base weight's rows (``megatron_tables``: linear_qkv per query
group its query heads, key, value; a gated linear_fc1 [gate; up]), and its one A serves every
projection the linear stacks: each HF projection gets that A and its own rows of B, which computes
the same product. Tensor-parallel shards, as Megatron's ``ParallelLinearAdapter`` cuts them: on a
column-parallel linear (qkv, fc1) A on its rank dim ([dim/tp, in]) and B like the base weight
(``megatron_slabs`` places it, fc1's [gate_r; up_r] included); on a row-parallel one (proj, fc2) A
like the base weight (its input columns) and B on its output rows ([out/tp, dim]); the canonical
form's B of one projection on its rows. The shards are reassembled into full tensors, and every
element must arrive exactly once."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_async.models.lora.peft_format import AdapterConfig, AdapterWeights, LoRAError
from megatron_async.models.megatron_layouts import Dims, NameMap, Shard, megatron_slabs
from megatron_async.models.slab_loading import Slab, WeightUpdateError

_NAME = re.compile(r"^(?:module\.)*(?P<base>.+\.(?P<linear>linear_qkv|linear_proj|linear_fc1|linear_fc2))\.adapter"
                   r"(?:\.adapter_(?P<part>q|k|v|gate|up))?\.linear_(?P<which>in|out)\.weight$")
_PART = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
_ROW_PARALLEL = ("linear_proj", "linear_fc2")


def is_megatron_name(name) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


def megatron_source(source) -> tuple[Mapping | None, list] | None:
    """(config dict | None, the shards) of an adapter in Megatron-Core's naming, else None. Forms:
    a mapping of full tensors; a list of mappings, the shards of tensor-parallel ranks 0, 1, ...;
    a list of (mapping, ``Shard``) pairs; or a pair (config dict, any of these)."""
    config = None
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], Mapping) \
            and not any(isinstance(v, torch.Tensor) for v in source[0].values()):
        config, source = source
    if isinstance(source, Mapping):
        shards = [(source, Shard())]
    elif isinstance(source, list) and source and all(isinstance(s, Mapping) for s in source):
        shards = [(s, Shard(tp_rank=i, tp_size=len(source))) for i, s in enumerate(source)]
    elif isinstance(source, list) and source and all(
            isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], Mapping) and isinstance(s[1], Shard)
            for s in source):
        shards = list(source)
    else:
        return None
    return (config, shards) if any(is_megatron_name(n) for n in shards[0][0]) else None


def megatron_config(cfg: Mapping | None) -> AdapterConfig | None:
    """Megatron's ``dim`` / ``alpha`` (or PEFT's keys) as an ``AdapterConfig``."""
    if cfg is None:
        return None
    if "dim" in cfg:
        cfg = {"r": cfg["dim"], "lora_alpha": cfg.get("alpha", cfg["dim"]),
               **{k: v for k, v in cfg.items() if k not in ("dim", "alpha")}}
    return AdapterConfig.from_dict(cfg)


class _Full:
    """One full tensor being assembled from boxes, each element exactly once (on the device and in
    the dtype of its first piece: a refit's pieces stay where they arrived)."""

    def __init__(self, shape: tuple[int, ...], what: str):
        self.shape, self.what = tuple(shape), what
        self.tensor = self.seen = None

    def put(self, offset: Sequence[int], piece: torch.Tensor) -> None:
        box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
        if any(s.stop > n for s, n in zip(box, self.shape)):
            raise LoRAError(f"{self.what}: a piece of shape {tuple(piece.shape)} at {tuple(offset)} lies outside "
                            f"its full shape {self.shape} (an adapter of another base model?)")
        if self.tensor is None:
            self.tensor = torch.zeros(self.shape, dtype=piece.dtype, device=piece.device)
            self.seen = torch.zeros(self.shape, dtype=torch.bool)
        if self.seen[box].any():
            raise LoRAError(f"{self.what}: a piece at {tuple(offset)} arrives twice (shards given twice?)")
        self.seen[box] = True
        self.tensor[box] = piece.detach()


def read_megatron_adapter(shards: list[tuple[Mapping, Shard]], names: NameMap, dims: Dims,
                          full_shapes: Callable[[str, int], tuple[tuple, tuple]],
                          config: AdapterConfig | None) -> AdapterWeights:
    """``full_shapes(module, rank)``: the checkpoint shapes (A, B) of an HF module's adapter
    (LoRAError for a module the model does not adapt)."""
    entries = []
    for tensors, shard in shards:
        for name, t in tensors.items():
            m = _NAME.match(name) if isinstance(name, str) else None
            if m is None:
                raise LoRAError(f"unexpected adapter tensor {name!r} (expected Megatron-Core <linear>.adapter"
                                "[.adapter_<proj>].linear_in.weight / linear_out.weight)")
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise LoRAError(f"adapter tensor {name!r} must be a 2-D floating-point tensor")
            found = names.match(m["base"] + ".weight")
            if found is None:
                raise LoRAError(f"{name}: {m['base']} is no linear of this model ({names.arch})")
            rule, fields = found
            layer = fields.get("layer", 0) + shard.layer_offset
            modules = [h.format(layer=layer)[: -len(".weight")] for h in rule.hf]
            if m["part"] is not None:
                if _PART[m["part"]] >= len(modules):
                    raise LoRAError(f"{name}: this model's {m['linear']} has no {m['part']} projection")
                modules = [modules[_PART[m["part"]]]]
            entries.append((name, t, shard, m, modules))
    ranks = {}
    for name, t, _, m, modules in entries:
        if m["which"] == "out":
            for module in modules:
                ranks[module] = t.shape[1]
    full: dict[tuple[str, str], _Full] = {}

    def target(module: str, which: str, name: str) -> _Full:
        if module not in ranks:
            raise LoRAError(f"{name}: {module} has linear_in but no linear_out")
        key = (module, which)
        if key not in full:
            shape_a, shape_b = full_shapes(module, ranks[module])
            full[key] = _Full(shape_a if which == "A" else shape_b, f"{module}.lora_{which}")
        return full[key]

    for name, t, shard, m, modules in entries:
        row_parallel = m["linear"] in _ROW_PARALLEL
        fused = m["part"] is None and len(modules) > 1
        if m["which"] == "in" and row_parallel:  # cut like the base weight: its input columns
            for slab in _laid(names, dims, name, m["base"], t, shard):
                target(slab.hf_name[: -len(".weight")], "A", name).put(slab.offset, slab.tensor)
        elif m["which"] == "in":  # column-parallel: cut on the rank dim, one A for every stacked projection
            for module in modules:
                target(module, "A", name).put((shard.tp_rank * t.shape[0], 0), t)
        elif fused:  # the base weight's rows and cut
            for slab in _laid(names, dims, name, m["base"], t, shard):
                target(slab.hf_name[: -len(".weight")], "B", name).put(slab.offset, slab.tensor)
        else:  # one projection's rows, cut contiguously
            target(modules[0], "B", name).put((shard.tp_rank * t.shape[0], 0), t)
    modules = {}
    for (module, which), f in full.items():
        if not f.seen.all():
            raise LoRAError(f"{f.what}: {int((~f.seen).sum())} of its {f.seen.numel()} values are missing "
                            "(a tensor-parallel shard not given?)")
        if which == "A":
            if (module, "B") not in full:
                raise LoRAError(f"{module}: linear_in and linear_out must come together")
            modules[module] = (f.tensor, full[(module, "B")].tensor)
    if not modules:
        raise LoRAError("the adapter has no linear_in / linear_out pairs")
    if len(set(ranks.values())) != 1 or (config is not None and set(ranks.values()) != {config.rank}):
        raise LoRAError(f"the tensors have ranks {sorted(set(ranks.values()))}"
                        + (f", the config says dim={config.rank}" if config is not None else ""))
    r = next(iter(ranks.values()))
    return AdapterWeights(config or AdapterConfig(r, float(r)), modules)


def _laid(names: NameMap, dims: Dims, name: str, base: str, t: torch.Tensor, shard: Shard) -> list[Slab]:
    """``t`` laid out and cut as ``base``'s weight is: the boxes of HF tensors it fills."""
    try:
        return megatron_slabs(names, dims, base + ".weight", tuple(t.shape), t, shard)
    except WeightUpdateError as e:
        raise LoRAError(f"{name} {tuple(t.shape)} (shard {shard.tp_rank} of {shard.tp_size}): {e}") from None
