"""Rank function of the per-rank IPC refit tests: ranks [0, tp) are a trainer's TP ranks, ranks
[tp, 2 tp) a TP engine's (``LLM``, built-in "tiny" model); trainer rank r and engine rank r share a
device (CPU: shared memory; GPU r). Each trainer rank shares its Megatron-Core shards, replicated
copies included, with ``ipc.Sharer(...).share(items, engine_rank=r)``; every engine rank gets the
list of all of them, takes its own, and after two updates (the trainer's in-place change between
them) generates the tokens of the same weights given in-process under HF names."""
from __future__ import annotations

import json
import os
from datetime import timedelta

import torch

from megatron_async.config import InferenceConfig
from megatron_async.llm import LLM
from megatron_async.weight_transfer import NameMap, Shard, ipc, megatron_from_hf, megatron_names_of
from tests.helpers.refit_engine import GREEDY, PROMPTS, new_hf

SEED = 11


def _tiny_info() -> tuple[dict, object, str]:
    llm = LLM(default_model="tiny", seed=0, inference_config=InferenceConfig(num_kv_blocks=16))
    return llm.model.hf_shapes(), llm.model.megatron_dims(), llm.model.spec.name


def per_rank_refit(rank: int, world: int, port: int, device: str):
    tp = world // 2
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=240))
    if rank < tp:
        return _trainer(rank, tp, store, device)
    return _engine(rank - tp, tp, store, device)


def _trainer(r: int, tp: int, store, device: str) -> dict:
    if device == "cuda":
        torch.cuda.set_device(r)
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
    shapes, dims, arch = _tiny_info()
    hf, names, shard = new_hf(shapes, SEED), NameMap.for_arch(arch), Shard(tp_rank=r, tp_size=tp)
    shards = megatron_from_hf(names, dims, hf, megatron_names_of(names, hf, dims, shard), shard)
    # a storage per tensor (a plain GPTModel's parameters), every copy this rank holds
    items = [(n, t.to(device).clone().share_memory_() if device == "cpu" else t.to(device).clone(), shard)
             for n, t in shards.items()]
    sharer = ipc.Sharer()
    first = sharer.share(items, engine_rank=r)
    if device == "cuda":
        torch.cuda.synchronize()
    store.set(f"payload/1/{r}", json.dumps(first))
    store.wait([f"done/1/{e}" for e in range(tp)])
    with torch.no_grad():
        for _, t, _ in items:
            t.mul_(2.0)  # the next optimizer step, in place
    if device == "cuda":
        torch.cuda.synchronize()
    second = sharer.share(items, engine_rank=r)
    store.set(f"payload/2/{r}", json.dumps(second))
    store.wait([f"done/2/{e}" for e in range(tp)])
    # A payload entry names one allocator segment, spanning the storages its ref_counters count
    storages = sum(1 + len(e.get("ref_counters", ())) for e in first["storages"])
    return {"same_payload": second == first, "shared": sharer.shared, "storages": storages,
            "segments": len(first["storages"])}


def _generate(llm: LLM) -> list[list[int]]:
    return [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)]


def _engine(e: int, tp: int, store, device: str) -> dict:
    os.environ.update({"RANK": str(e), "LOCAL_RANK": str(e), "WORLD_SIZE": str(tp)})
    if device == "cuda":
        torch.cuda.set_device(e)
    llm = LLM(default_model="tiny", seed=0, device=device, dtype="float32", tensor_parallel_size=tp,
              inference_config=InferenceConfig(num_kv_blocks=64, cuda_graphs=False))
    try:
        weights, out = llm.engine.weights, {"rank": e}
        for k in (1, 2):
            store.wait([f"payload/{k}/{r}" for r in range(tp)])
            payloads = [json.loads(store.get(f"payload/{k}/{r}")) for r in range(tp)]
            if k == 1 and device == "cuda":  # each payload addressed to the next rank: another GPU's memory
                shifted = [{**p, "engine_rank": (p["engine_rank"] - 1) % tp} for p in payloads]
                try:
                    llm.engine.update_weights_from_ipc(shifted)
                except ipc.IpcHandleError as err:
                    out["other_gpu"] = str(err)
            text = json.dumps(payloads)
            out[f"version{k}"] = llm.engine.update_weights_from_ipc(text)
            out[f"opened{k}"] = weights._storages.opened
            out[f"tokens{k}"] = _generate(llm)
            store.set(f"done/{k}/{e}", "1")
        out["unchanged"] = weights._payloads.unchanged
        out["plans"] = (weights.plans.misses, weights.plans.hits, weights.plans.reused)
        for k, scale in ((2, 2.0), (1, 1.0)):  # the same weights in-process, under HF names
            llm.update_weights({n: t * scale for n, t in new_hf(llm, SEED).items()})
            out[f"want{k}"] = _generate(llm)
        return out
    finally:
        llm.close()
