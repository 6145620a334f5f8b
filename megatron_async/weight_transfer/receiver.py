"""The engine's side of a bucketed transfer: plan the whole manifest once (the one slab loader:
names, shapes, dtypes, shards, coverage, all before any byte moves), then copy each bucket into
place as it arrives, through one bucket buffer (never a second copy of the weights). The begin
frame is its own step (``prepare_begin``, ``TransferGroup.frame``, ``after_begin``), so that the
engine can wait for the senders off its step loop and copy between two steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_async.models.slab_loading import CopyProgram, WeightPlan
from megatron_async.models.weight_update import CopyPlanCache, plan_update
from megatron_async.weight_transfer.group import TransferFailed, TransferGroup
from megatron_async.weight_transfer.manifest import Manifest


@dataclass
class ReceiveStats:
    buckets: int = 0
    elements_copied: int = 0
    buffer_bytes: int = 0
    """Bytes the receive allocated beyond the model (its one bucket buffer)."""


def plan_manifest(model: nn.Module, manifest: Manifest, cache: CopyPlanCache | None = None
                  ) -> tuple[WeightPlan, CopyProgram]:
    """The checked plan and copy program of ``manifest`` (input i = the i-th tensor entry);
    ``WeightUpdateError`` for a manifest this model cannot take."""
    entries = manifest.entries()

    def metas():
        return [(e.name, e.shape, e.torch_dtype, e.shard, e.rows) for e in entries]

    if cache is None:
        return plan_update(model, metas(), manifest.weights_format)
    return cache.get(model, ("manifest", manifest.to_json()), metas, manifest.weights_format)


class Refused(Exception):
    """Why this engine rank refused an update at the begin frame (the caller's error to raise)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@dataclass
class Begin:
    """This rank's part of a transfer's begin frame, made before the frame: the manifest, and
    the plan and copy program or the error that refuses it."""
    manifest: Manifest | None
    plan: WeightPlan | None = None
    program: CopyProgram | None = None
    error: Exception | None = None

    @property
    def frame(self) -> tuple[int, int]:
        """What this rank puts in the begin frame: (status, manifest digest)."""
        return 1 if self.error else 0, 0 if self.manifest is None else self.manifest.digest()


def prepare_begin(manifest: Manifest | None, prepare) -> Begin:
    """``prepare()`` returns (plan, program) or raises to refuse; a ``manifest`` of None is
    refused too (this rank still joins the begin frame with its refusal, so no sender waits)."""
    try:
        if manifest is None:
            raise ValueError("no manifest")
        plan, program = prepare()
    except Exception as e:  # noqa: BLE001 -- reported to every rank by the begin frame
        return Begin(manifest, error=e)
    return Begin(manifest, plan, program)


def receive(group: TransferGroup, manifest: Manifest | None, prepare) -> ReceiveStats:
    """Take part in one transfer: ``prepare_begin``, the begin frame, ``after_begin``."""
    begin = prepare_begin(manifest, prepare)
    return after_begin(group, begin, group.frame(*begin.frame))


def after_begin(group: TransferGroup, begin: Begin, frames: list[tuple[int, int]],
                failure: Exception | None = None) -> ReceiveStats:
    """The rest of a transfer once every rank's begin ``frames`` arrived. This rank's refusal
    raises ``Refused(error)``, nothing copied; another rank's refusal or differing manifests raise
    ``TransferFailed``, nothing copied. After that a failure on any rank (``failure``: this rank
    cannot copy, found after the begin frame) raises ``TransferFailed`` (this rank keeps receiving
    until the end frame, so the group stays in step)."""
    if begin.error is not None:
        raise Refused(begin.error)
    if any(status for status, _ in frames) or len({h for _, h in frames}) != 1:
        raise TransferFailed(f"refused before any bucket moved (rank: (status, manifest digest)): {dict(enumerate(frames))}")
    manifest, plan, program = begin.manifest, begin.plan, begin.program
    stats = ReceiveStats(buffer_bytes=manifest.max_bucket_bytes)
    buf = torch.empty(manifest.max_bucket_bytes, dtype=torch.uint8, device=group.device)
    if failure is None:
        program.begin()
    index = 0
    for b in manifest.buckets:
        view = buf[: b.nbytes]
        group.broadcast(view, b.src)
        if failure is None:
            try:
                items = [(index + i, view[e.offset: e.offset + e.nbytes].view(e.torch_dtype).view(e.piece_shape))
                         for i, e in enumerate(b.tensors)]
                stats.elements_copied += program.run(items)
                stats.buckets += 1
            except Exception as e:  # noqa: BLE001 -- reported at the end frame
                failure = e
        index += len(b.tensors)
    del buf
    try:
        if failure is None:
            plan.finish(stats.elements_copied)
    except Exception as e:  # noqa: BLE001
        failure = e
    end = group.frame(0 if failure is None else 1, stats.elements_copied)
    if failure is not None:
        raise TransferFailed(f"this engine rank did not complete the update ({failure}); its weights are incomplete")
    if any(status for status, _ in end):
        raise TransferFailed(f"another engine rank did not complete the update: {dict(enumerate(end))}")
    return stats
