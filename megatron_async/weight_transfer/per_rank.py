"""Per-rank IPC payloads: a tensor-parallel trainer colocated with a tensor-parallel engine, one
process per GPU on both sides, each trainer rank sharing what lies on its GPU for the engine rank
on the same GPU (``ipc.share(items, engine_rank=r)``). The engine gets the list of every rank's
payload (one body for all its ranks: the server's rank 0 hands the same body to each) and each
engine rank takes only the payloads addressed to it, so it maps only memory of its own GPU and
no byte crosses GPUs.

A trainer rank's payload holds its copy of every tensor its ranks hold alike (TP-replicated
norms, non-expert tensors on every EP rank); the engine otherwise takes those only from rank 0 of
the ranks that hold them (``megatron_layouts.owns``), so in a per-rank update they count as that
rank's copy (``owned_copy``): each element still arrives exactly once per engine rank, the
plan's coverage check says so."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from megatron_async.models.megatron_layouts import NameMap, Shard
from megatron_async.models.megatron_tables import Split
from megatron_async.weight_transfer.ipc_storages import IpcHandleError


def addressed(payloads: list[Mapping], engine_rank: int, device_uuid: str | None = None) -> tuple[list[Mapping], bool]:
    """(the payloads engine rank ``engine_rank`` takes, whether they are addressed per rank). No
    payload naming an ``engine_rank``: all of them, for every rank; some naming one: every payload
    must, and this rank takes those naming it (at least one). ``device_uuid``: this rank's GPU, which
    every CUDA storage of its payloads must be on."""
    ranks = [p.get("engine_rank") for p in payloads]
    if all(r is None for r in ranks):
        return payloads, False
    for r in ranks:
        if type(r) is not int or r < 0:
            raise IpcHandleError(f"engine_rank must be an int >= 0 in every payload of a per-rank update, got {r!r}")
    mine = [p for p, r in zip(payloads, ranks) if r == engine_rank]
    if not mine:
        raise IpcHandleError(f"no payload for engine rank {engine_rank} (payloads for ranks {sorted(set(ranks))})")
    if device_uuid is not None:
        for p in mine:
            for s in p["storages"]:
                if isinstance(s, Mapping) and s.get("kind") == "cuda" and s.get("device_uuid") != device_uuid:
                    raise IpcHandleError(f"the payload for engine rank {engine_rank} names GPU {s.get('device_uuid')}; "
                                         f"this rank runs on {device_uuid} (a per-rank payload shares its own GPU's memory)")
    return mine, True


def owned_copy(names: NameMap, name: str, shard: Shard) -> Shard:
    """``shard`` as the copy the engine takes of a tensor several trainer ranks hold alike: rank 0
    of the ranks that hold it (a tensor split over them keeps its shard)."""
    found = names.match(name)
    if found is None:
        return shard  # (the plan names it unknown)
    rule = found[0]
    if rule.expert:
        if rule.split != Split.REPLICATED or shard.expert_tp()[0] == 0:
            return shard
        if shard.etp_size is None:
            return dataclasses.replace(shard, tp_rank=0)
        return dataclasses.replace(shard, etp_rank=0)
    if rule.split == Split.REPLICATED:
        return dataclasses.replace(shard, tp_rank=0, ep_rank=0)
    return dataclasses.replace(shard, ep_rank=0) if shard.ep_rank else shard
