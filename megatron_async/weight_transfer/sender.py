"""The trainer's side of a transfer: which tensors a Megatron-Core rank sends, and ``send``.

    group = init_transfer_group(addr, port, rank=0, world_size=1 + engine_ranks, backend="nccl")
    items = megatron_tensors(model)                   # this rank's (name, tensor, Shard)
    manifest = build_manifest(items, bucket_bytes=512 << 20, src=group.rank, version=step)
    # the engine: engine.update_weights_from_distributed(manifest) (or POST the manifest's JSON)
    send(group, manifest, items)

With several sending ranks, each builds its manifest with ``src`` = its transfer rank, the trainer
gathers them over its own group and gives the engine ``merge(manifests)``; every sender calls
``send`` with the merged manifest. Only one data-parallel replica of the trainer sends."""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatron_async.models.megatron_layouts import NameMap, Shard, owns
from megatron_async.models.megatron_tables import IGNORED_SUFFIXES
from megatron_async.weight_transfer.group import TransferFailed, TransferGroup
from megatron_async.weight_transfer.manifest import Manifest


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    return model


def megatron_shard(model=None) -> Shard:
    """This rank's place in the Megatron-Core job (``megatron.core.parallel_state``; defaults
    without one); ``model``: for the pipeline stage's layer offset."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return Shard()
    if not ps.model_parallel_is_initialized():
        return Shard()
    offset = 0
    config = getattr(_unwrap(model), "config", None) if model is not None else None
    if config is not None and ps.get_pipeline_model_parallel_world_size() > 1:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        offset = get_transformer_layer_offset(config)
    return Shard(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                 ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                 etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
                 layer_offset=offset)


def megatron_tensors(model, shard: Shard | None = None, architecture: str | None = None
                     ) -> list[tuple[str, torch.Tensor, Shard]]:
    """(name, tensor, Shard) of a Megatron-Core model's parameters on this rank (``shard``: from
    ``parallel_state`` when None). With ``architecture`` (the engine's HF ``architectures[0]``),
    copies another rank sends (replicated tensors off TP rank 0, non-expert tensors off EP rank 0)
    are left out, so no byte travels twice."""
    shard = shard or megatron_shard(model)
    return owned([(n, p.detach(), shard) for n, p in _unwrap(model).named_parameters()], architecture)


def owned(items: Iterable[tuple], architecture: str | None) -> list[tuple]:
    """``items`` without ``_extra_state`` entries and, with ``architecture``, without the copies
    the engine takes from another rank (``megatron_layouts.owns``)."""
    names = NameMap.for_arch(architecture) if architecture else None
    out = []
    for item in items:
        if item[0].endswith(IGNORED_SUFFIXES):
            continue
        found = names.match(item[0]) if names else None
        if found is not None and not owns(found[0], item[2] if len(item) > 2 and item[2] else Shard()):
            continue
        out.append(item)
    return out


def send(group: TransferGroup, manifest: Manifest, tensors: Mapping[str, torch.Tensor] | Iterable[tuple]) -> None:
    """Broadcast this rank's buckets of ``manifest`` and take part in the others'. ``tensors``:
    by name, or the (name, tensor[, Shard]) items the manifest was built from (a rank sending
    several shards of one name). Raises ``TransferFailed`` when an engine rank refused the
    manifest (nothing was copied) or did not copy everything it planned (its weights are then
    incomplete)."""
    tensors = _by_entry(tensors)
    problem = _check_own(group.rank, manifest, tensors)
    begin = group.frame(1 if problem else 0, manifest.digest())
    if problem:
        raise TransferFailed(f"this sender cannot send its buckets: {problem}")
    if any(status for status, _ in begin) or len({h for _, h in begin}) != 1:
        raise TransferFailed(f"the update was refused before any bucket moved (rank: (status, manifest digest)): "
                             f"{dict(enumerate(begin))}")
    buf = torch.empty(manifest.max_bucket_bytes, dtype=torch.uint8, device=group.device)
    for b in manifest.buckets:
        view = buf[: b.nbytes]
        if b.src == group.rank:
            for e in b.tensors:
                t = _lookup(tensors, e).detach()
                if e.rows is not None:
                    t = t[e.rows[0]: e.rows[1]]
                view[e.offset: e.offset + e.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        group.broadcast(view, b.src)
    end = group.frame(0, 0)
    if any(status for status, _ in end):
        raise TransferFailed(f"an engine rank did not complete the update (rank: (status, elements copied)): "
                             f"{dict(enumerate(end))}")


def _by_entry(tensors) -> dict:
    """name -> tensor, and (name, Shard) -> tensor for items that carry a shard."""
    if isinstance(tensors, Mapping):
        return dict(tensors)
    out = {}
    for name, t, *rest in tensors:
        out[(name, rest[0] if rest and rest[0] is not None else Shard())] = t
    return out


def _lookup(tensors: dict, e) -> torch.Tensor | None:
    t = tensors.get((e.name, e.shard))
    return tensors.get(e.name) if t is None else t


def _check_own(rank: int, manifest: Manifest, tensors: dict) -> str | None:
    """What is wrong with this sender's tensors for its buckets (None: nothing)."""
    for b in manifest.buckets:
        if b.src != rank:
            continue
        for e in b.tensors:
            t = _lookup(tensors, e)
            if t is None:
                return f"no tensor {e.name!r}"
            if tuple(t.shape) != e.shape or t.dtype != e.torch_dtype:
                return f"{e.name} is {tuple(t.shape)} {t.dtype}, the manifest says {e.shape} {e.dtype}"
    return None
