"""Weights from a training job to the engine, one protocol for both sides.

Trainer side (importable without building an engine):
  ``Shard``                     where a Megatron-Core tensor sits (tp / ep / expert-tp ranks, layer offset)
  ``megatron_tensors(model)``   a Megatron-Core rank's (name, tensor, Shard) to send
  ``init_transfer_group(...)``  join the transfer group (gloo on CPU, NCCL on GPUs); ``free_port()`` for its port
  ``build_manifest`` / ``merge`` the bucketed, JSON manifest of an update
  ``send(group, manifest, tensors)``  broadcast this rank's buckets; ``TransferFailed`` if refused
  ``ipc.share(items)``          a JSON payload of CUDA IPC / shared-memory handles (colocated);
                                ``ipc.Sharer().share(items[, engine_rank])``: the same payload every step
  ``megatron_from_hf``, ``megatron_names_of``: a trainer rank's shards built from HF tensors

Engine side: ``engine.init_weight_transfer``, ``engine.update_weights_from_distributed``,
``engine.update_weights_from_ipc`` (``inference/engines/weight_receiver.py``)."""
from megatron_async.models.megatron_layouts import Dims, NameMap, Shard, megatron_from_hf, megatron_names_of
from megatron_async.weight_transfer.group import TransferFailed, TransferGroup, free_port, init_transfer_group
from megatron_async.weight_transfer.manifest import Manifest, ManifestError, build_manifest, merge
from megatron_async.weight_transfer.sender import megatron_shard, megatron_tensors, owned, send

__all__ = ["Dims", "Manifest", "ManifestError", "NameMap", "Shard", "TransferFailed", "TransferGroup",
           "build_manifest", "free_port", "init_transfer_group", "megatron_from_hf", "megatron_names_of",
           "megatron_shard", "megatron_tensors", "merge", "owned", "send"]
