"""Rank functions of the refit engine tests: a trainer process (Megatron-Core shards of new weights,
built from HF tensors) and an engine process (``LLM``) that takes them over a gloo transfer group
or shared-memory IPC handles, then generates."""
from __future__ import annotations

import json
from datetime import timedelta

import torch

from megatron_async.config import InferenceConfig
from megatron_async.inference.request import SamplingParams
from megatron_async.llm import LLM
from megatron_async.models.default_model import random_hf_tensors
from megatron_async.weight_transfer import (
    NameMap, Shard, build_manifest, init_transfer_group, megatron_from_hf, megatron_names_of, merge, owned, send,
)
from megatron_async.weight_transfer import ipc

PROMPTS = [[5, 17, 99, 3], [42, 7]]
GREEDY = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True, return_log_probs=True)


def engine() -> LLM:
    # a pool for two short requests: the CPU default (1 GB) is zeroed at every build, in every test's engine
    return LLM(default_model="tiny", seed=0, inference_config=InferenceConfig(num_kv_blocks=64))


def new_hf(llm_or_shapes, seed: int) -> dict[str, torch.Tensor]:
    shapes = llm_or_shapes.model.hf_shapes() if isinstance(llm_or_shapes, LLM) else llm_or_shapes
    return dict(random_hf_tensors(shapes, torch.float32, torch.device("cpu"), 0.05, seed))


def trainer_items(shapes: dict, seed: int, tp: int, dims, arch: str) -> list[tuple]:
    """Every TP rank's (name, shard, Shard) of the new weights (replicated copies left out)."""
    hf = new_hf(shapes, seed)
    names, items = NameMap.for_arch(arch), []
    for r in range(tp):
        shard = Shard(tp_rank=r, tp_size=tp)
        tensors = megatron_from_hf(names, dims, hf, megatron_names_of(names, hf, dims, shard), shard)
        items += owned([(n, t, shard) for n, t in tensors.items()], arch)
    return items


def generate(llm: LLM):
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.generated_tokens, o.generated_log_probs, o.weight_versions) for o in outs]


def reference(seed: int, scale: float = 1.0):
    """The engine updated in-process with the same new weights under HF names."""
    llm = engine()
    llm.update_weights({n: t * scale for n, t in new_hf(llm, seed).items()})
    return generate(llm)


def _shape_info():
    llm = engine()
    return llm.model.hf_shapes(), llm.model.megatron_dims(), llm.model.spec.name


def distributed_rank(rank: int, world: int, port: int):
    shapes, dims, arch = _shape_info()
    items = trainer_items(shapes, 11, 2, dims, arch)
    manifest = merge([build_manifest(items, 32 << 10, src=0, version=7)])
    if rank == 0:
        group = init_transfer_group("127.0.0.1", port, 0, world, "gloo", timeout_s=60)
        for _ in range(2):
            send(group, manifest, items)
        return "sent"
    llm = engine()
    joined = llm.engine.init_weight_transfer("127.0.0.1", port, 1, world)
    versions = [llm.engine.update_weights_from_distributed(manifest.to_json()) for _ in range(2)]
    plans = llm.engine.weights.plans
    return joined, versions, (plans.misses, plans.hits), llm.engine.weights.last_receive.buffer_bytes, generate(llm)


def ipc_rank(rank: int, world: int, port: int):
    """Rank 0 shares its tensors (shared memory) and changes them in place between two updates."""
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    if rank == 0:
        torch.multiprocessing.set_sharing_strategy("file_system")
        shapes, dims, arch = _shape_info()
        items = trainer_items(shapes, 11, 2, dims, arch)
        for _, t, _ in items:
            t.share_memory_()
        store.set("payload", json.dumps(ipc.share(items)))
        store.wait(["first"])
        with torch.no_grad():
            for _, t, _ in items:
                t.mul_(2.0)  # the next optimizer step, in the same storage
        store.set("changed", "1")
        store.wait(["second"])
        return "shared"
    payload = store.get("payload").decode()
    llm = engine()
    first = llm.engine.update_weights_from_ipc(payload)
    out1 = generate(llm)
    store.set("first", "1")
    store.wait(["changed"])
    second = llm.engine.update_weights_from_ipc(json.loads(payload))
    out2 = generate(llm)
    store.set("second", "1")
    plans = llm.engine.weights.plans
    weights = llm.engine.weights
    return (first, second), (plans.misses, plans.hits, weights._payloads.reused, tuple(weights.last_ipc_ms)), out1, out2
