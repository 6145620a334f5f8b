"""Rank functions of the refit transfer tests (run by tests.helpers.multiprocess.run_ranks): a
trainer's sending ranks and engine ranks in one transfer group over gloo or NCCL."""
from __future__ import annotations

import torch

from megatron_async.weight_transfer import TransferFailed, build_manifest, init_transfer_group, merge, send
from megatron_async.weight_transfer.receiver import Refused, plan_manifest, receive
from tests.helpers.refit_models import build, hf_weights, load_full, trainer_shards

ARCH = {"dense": "Qwen3ForCausalLM", "dense_tp4": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM", "hybrid": "NemotronHForCausalLM"}


def manifests(kind: str, trainer_tp: int, bucket_bytes: int, seed: int = 5):
    """(each sender's items, the merged manifest): sender r is transfer rank r."""
    from megatron_async.weight_transfer.sender import owned

    shards = trainer_shards(kind, hf_weights(kind, seed), trainer_tp, padded_vocab=256)
    items = [owned(rank_items, ARCH[kind]) for rank_items in shards]
    merged = merge([build_manifest(it, bucket_bytes, src=r, version=7) for r, it in enumerate(items)])
    return items, merged


class _Planted:
    """A copy program whose bucket ``bucket`` is skipped or applied twice."""

    def __init__(self, program, bug: str):
        self.program, self.bug, self.calls = program, bug, 0

    def begin(self):
        self.program.begin()

    def run(self, items):
        items = list(items)
        self.calls += 1
        if self.bug == "skip" and self.calls == 2:
            return 0
        copied = self.program.run(items)
        return copied + (self.program.run(items) if self.bug == "twice" and self.calls == 1 else 0)


def transfer_rank(rank: int, world: int, port: int, backend: str, kind: str, trainer_tp: int, engine_tp: int,
                  bucket_bytes: int, plant: str | None = None):
    """Senders [0, trainer_tp), engine ranks after them. Returns ("sent" | error text) for a
    sender, (weights equal to the HF-loaded engine, untouched, buffer bytes, error text) for an engine rank."""
    items, manifest = manifests(kind, trainer_tp, bucket_bytes)
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    group = init_transfer_group("127.0.0.1", port, rank, world, backend, timeout_s=60, device=device)
    if rank < trainer_tp:
        tensors = {n: t.to(device) if device else t for n, t, _ in items[rank]}
        try:
            send(group, manifest, tensors)
            return "sent"
        except TransferFailed as e:
            return f"failed: {e}"
    r = rank - trainer_tp
    model = build(kind, engine_tp, r).to(device or "cpu")
    if plant == "unknown":
        bad = manifest.to_json().replace("decoder.layers.1.self_attention.linear_proj.weight",
                                         "decoder.layers.1.self_attention.nope.weight")
        manifest = type(manifest).from_json(bad)
    if plant == "digest" and r == 1:
        manifest = type(manifest).from_json(manifest.to_json().replace('"version":7', '"version":8'))

    def prepare():
        plan, program = plan_manifest(model, manifest)
        return plan, (_Planted(program, plant) if plant in ("skip", "twice") and r == 0 else program)

    error, stats = None, None
    try:
        stats = receive(group, manifest, prepare)
    except (Refused, TransferFailed) as e:
        error = f"{type(e).__name__}: {e}"
    want = load_full(build(kind, engine_tp, r), hf_weights(kind, 5))
    equal = all(torch.equal(p.cpu(), q) for p, q in zip(model.parameters(), want.parameters()))
    untouched = all(not p.any() for p in model.parameters())
    return equal, untouched, stats.buffer_bytes if stats else None, error
