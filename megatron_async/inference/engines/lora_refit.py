"""An adapter's new weights from a training job (RL with LoRA), through the weight-transfer
machinery (``megatron_async.weight_transfer``): the trainer sends the adapter's tensors, PEFT-named
or in Megatron-Core's naming with their shards (models/lora/megatron_format.py), and the engine
rewrites the adapter in place with them (``LoRAControl.update``: the whole adapter checked before
anything is written, the weight version bumped). Like a weight update it lands between two steps:
requests of that adapter in flight go on with the new weights from the next launch, keeping their
KV; a failed or refused transfer leaves the adapter as it was.

  ``start_distributed``  a bucketed broadcast over the transfer group (a ``build_manifest``
                         manifest): the buckets are gathered into tensors of their own (an adapter
                         is small; its slots are not the model's weights, so no copy plan), then
                         the adapter is updated. The wait for the senders runs off the engine
                         thread (a ``PendingTransfer``, one transfer-group operation at a time).
  ``from_ipc``           a colocated trainer's storages (``ipc.share``, CUDA IPC / shared memory):
                         copied out, unmapped, then the update."""
from __future__ import annotations

import math
import re

import torch

from megatron_async.models.lora.megatron_format import is_megatron_name
from megatron_async.models.lora.peft_format import LoRAError
from megatron_async.models.megatron_layouts import Shard
from megatron_async.weight_transfer import ipc
from megatron_async.weight_transfer.group import TransferFailed
from megatron_async.weight_transfer.manifest import _SHARD_FIELDS, Manifest, ManifestError
from megatron_async.weight_transfer.pending import PendingTransfer
from megatron_async.weight_transfer.receiver import Refused, after_begin, prepare_begin

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?.+\.lora_[AB](?:\.[A-Za-z0-9_-]+)?\.weight$")


def adapter_source(items) -> dict | list:
    """(name, Shard, tensor) items as ``load_lora`` / ``update_lora`` take them: one mapping when
    every tensor is whole, else a list of (mapping, Shard) by shard."""
    by_shard: dict[Shard, dict] = {}
    for name, shard, t in items:
        by_shard.setdefault(shard, {})[name] = t
    if list(by_shard) == [Shard()]:
        return by_shard[Shard()]
    return [(tensors, shard) for shard, tensors in by_shard.items()]


def _check_names(names) -> None:
    bad = [n for n in names if not (is_megatron_name(n) or _PEFT_NAME.match(n))]
    if bad:
        raise LoRAError(f"not LoRA adapter tensors (PEFT's lora_A / lora_B or Megatron-Core's adapter.linear_in / "
                        f"linear_out names): {bad[:4]}")


class GatheredTensors:
    """The plan and copy program ``receiver.after_begin`` drives for an adapter: each tensor of the
    manifest (its pieces of rows) gathered into a tensor of its own on ``device``."""

    def __init__(self, manifest: Manifest, device: torch.device):
        self.entries, self.device = manifest.entries(), device
        self.tensors: dict[tuple[str, Shard], torch.Tensor] = {}
        self.expected = sum(math.prod(e.piece_shape) for e in self.entries)

    def begin(self) -> None:
        self.tensors.clear()

    def run(self, items) -> int:
        copied = 0
        for index, view in items:
            e = self.entries[index]
            full = self.tensors.get((e.name, e.shard))
            if full is None:
                full = self.tensors[(e.name, e.shard)] = torch.empty(e.shape, dtype=e.torch_dtype, device=self.device)
            (full if e.rows is None else full[e.rows[0]: e.rows[1]]).copy_(view)
            copied += view.numel()
        return copied

    def finish(self, copied: int) -> None:
        if copied != self.expected:
            raise TransferFailed(f"{copied} adapter values arrived, the manifest has {self.expected}")

    def source(self) -> dict | list:
        return adapter_source((name, shard, t) for (name, shard), t in self.tensors.items())


def _loaded(lora, name: str) -> None:
    if name not in lora.adapters.loaded:
        raise LoRAError(f"no adapter {name!r} is loaded (loaded: {sorted(lora.adapters.loaded)}): load_lora first")


def start_distributed(receiver, lora, name: str, metadata) -> PendingTransfer:
    """Begin receiving new weights of loaded adapter ``name`` as ``metadata`` (a ``Manifest``, its
    dict or JSON) describes; ``finish()`` (between two steps) gathers the buckets, updates the
    adapter and returns the new weight version. A bad manifest, an unknown adapter or tensors that
    are no adapter's are refused in the begin frame (the trainer's ``send`` fails, nothing moves)."""
    from megatron_async.inference.engines.weight_receiver import _bound

    receiver._check_no_pending()
    group = receiver.group
    if group is None:
        raise ValueError("no weight transfer group: call init_weight_transfer first")
    manifest, error = None, None
    try:
        if metadata is None:
            raise ManifestError("no manifest was given")
        manifest = Manifest.from_json(metadata)
        _loaded(lora, name)
        _check_names({e.name for e in manifest.entries()})
    except ValueError as e:  # (ManifestError, LoRAError)
        error = e

    def prepare():
        if error is not None:
            raise error
        receiver.engine.memory.check_can_update_weights()
        gathered = GatheredTensors(manifest, next(receiver.model.parameters()).device)
        return gathered, gathered

    begin = prepare_begin(manifest, prepare)

    def finish(frames, failed):
        receiver.pending = None
        if failed is not None:  # the group's collectives are out of step: it is of no more use
            receiver.destroy()
            raise TransferFailed(f"no update of LoRA adapter {name!r} began on the transfer group at {group.where} "
                                 f"within its timeout of {group.timeout_s:g} s ({failed}); the group is closed: "
                                 "init_weight_transfer again") from None
        try:
            after_begin(group, begin, frames)
        except Refused as r:
            raise r.error from None
        return lora.update(name, begin.plan.source())

    receiver.pending = PendingTransfer(f"an update of LoRA adapter {name!r} from the transfer group at {group.where}",
                                       lambda: group.frame(*begin.frame), finish, _bound(group.timeout_s))
    return receiver.pending


def from_ipc(receiver, lora, name: str, handles) -> int:
    """New weights of loaded adapter ``name`` from a colocated trainer's shared storages (one
    ``ipc.share`` payload or a list, one per trainer rank); the new weight version."""
    _loaded(lora, name)
    receiver.engine.memory.check_can_update_weights()
    _, storages, tensors = ipc.parse(handles)
    _check_names({t["name"] for t in tensors})
    mapped = ipc.IpcStorages()
    try:
        opened = mapped.open(storages)
        items = [(t["name"], Shard(**{k: t[k] for k in _SHARD_FIELDS if k in t}), v.clone())
                 for t, v in zip(tensors, ipc.views(opened, tensors))]
        if any(st.device.type == "cuda" for st in opened):
            torch.cuda.current_stream(opened[0].device).synchronize()  # done reading before the trainer moves on
    finally:
        mapped.release()
    return lora.update(name, adapter_source(items))
