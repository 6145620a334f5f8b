"""CUDA IPC refit on one GPU, the colocated case: a trainer process holds a model's weights under
Megatron-Core names on the GPU the engine uses, in one flat bf16 buffer (``--layout flat``, as
Megatron-Core's DDP keeps them) or a storage per tensor (``--layout separate``, as a plain
GPTModel holds its parameters), shares them once per step (``weight_transfer.ipc.share``), and the
engine copies from them (``update_weights_from_ipc``). Times the first update (plan, mapping), the
next ones (plan cached, storages kept) and one device copy of the same bytes, checks that the
trainer's in-place change between updates arrives, and that the engine then generates the tokens
of the same weights given in-process under HF names.

    python -m tests.helpers.refit_ipc_gpu --default-model qwen3-0.6b --layout separate --json out.json"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.multiprocess import free_port

SEED = 5


@dataclass
class IpcReport:
    model: str
    layout: str = "flat"
    """"flat": one storage for every tensor; "separate": a storage per tensor."""
    weight_bytes: int = 0
    copy_ms: float = 0.0
    """One device copy of the engine's weight bytes (median of a few): the floor a refit approaches."""
    first_ms: float = 0.0
    """The first update: plan, mapping the storage, copy."""
    hot_ms: list[float] = field(default_factory=list)
    """Later updates of the same tensors (plan cached, storage kept): copy only."""
    plan_hits: int = 0
    first_phases: dict = field(default_factory=dict)
    """The engine's host time of the first update by phase (``WeightReceiver.last_ipc_ms``)."""
    hot_phases: dict = field(default_factory=dict)
    """The same of the last update."""
    change_arrived: bool = False
    tokens_equal: bool = False


def _hf_tensors(shapes: dict, device) -> dict:
    from megatron_async.models.default_model import random_hf_tensors

    return dict(random_hf_tensors(shapes, torch.bfloat16, torch.device(device), 0.02, SEED))


def trainer_items(shapes: dict, dims, arch: str, device, layout: str = "flat") -> tuple[list[torch.Tensor], list[tuple]]:
    """(the buffers the trainer changes in place, its (Megatron name, view, Shard) items): one flat
    storage for every tensor, or (``layout`` "separate") a storage per tensor."""
    from megatron_async.weight_transfer import NameMap, Shard, megatron_from_hf, megatron_names_of

    names, hf = NameMap.for_arch(arch), _hf_tensors(shapes, device)
    tensors = megatron_from_hf(names, dims, hf, megatron_names_of(names, hf, dims))
    del hf
    if layout == "separate":
        own = {name: t.clone() for name, t in tensors.items()}  # (a view of a fused source keeps its storage)
        return list(own.values()), [(name, t, Shard()) for name, t in own.items()]
    total = sum(t.numel() for t in tensors.values())
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    items, offset = [], 0
    for name, t in tensors.items():
        view = flat[offset: offset + t.numel()].view(t.shape)
        view.copy_(t)
        items.append((name, view, Shard()))
        offset += t.numel()
    return [flat], items


def _trainer(port: int, shapes: dict, dims, arch: str, updates: int, layout: str) -> None:
    from megatron_async.weight_transfer import ipc

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    buffers, items = trainer_items(shapes, dims, arch, "cuda", layout)
    for k in range(updates):
        if k == 1:
            for b in buffers:
                b.mul_(2.0)  # an optimizer step, in place: the engine must see it at the next update
        torch.cuda.synchronize()
        store.set(f"payload/{k}", json.dumps(ipc.share(items)))
        store.wait([f"done/{k}"])


def copy_ms(nbytes: int, repeats: int = 5) -> float:
    """One device copy of ``nbytes`` (median ms): what a refit of that many bytes cannot beat."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def run(default_model: str, updates: int = 4, layout: str = "flat") -> IpcReport:
    from megatron_async import LLM, InferenceConfig, SamplingParams

    rep = IpcReport(default_model, layout)
    cfg = InferenceConfig(num_kv_blocks=64, max_requests=4, max_sequence_length=256)
    llm = LLM(default_model=default_model, device="cuda", dtype="bfloat16", inference_config=cfg)
    m = llm.model
    shapes, dims, arch = m.hf_shapes(), m.megatron_dims(), m.spec.name
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=600))
    proc = mp.get_context("spawn").Process(target=_trainer, args=(port, shapes, dims, arch, updates, layout),
                                        daemon=True)
    proc.start()
    probe = next(iter(llm.model.parameters()))
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True)
    try:
        for k in range(updates):
            payload = json.loads(store.get(f"payload/{k}"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.engine.update_weights_from_ipc(payload)  # returns once its copies are done
            ms = 1e3 * (time.perf_counter() - t0)
            if k == 0:
                rep.first_ms, before = ms, probe.detach().clone()
                rep.first_phases = dict(llm.engine.weights.last_ipc_ms)
            else:
                rep.hot_ms.append(ms)
                rep.hot_phases = dict(llm.engine.weights.last_ipc_ms)
            if k == 1:
                rep.change_arrived = torch.equal(probe.float(), 2 * before.float())
                tokens = [o.generated_tokens for o in llm.generate([[5, 17, 99, 3]], greedy)]
            store.set(f"done/{k}", "1")
        proc.join(120)
        rep.plan_hits = llm.engine.weights.plans.hits
        rep.weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        rep.copy_ms = copy_ms(rep.weight_bytes)
        hf = _hf_tensors(shapes, "cuda")
        for t in hf.values():
            t.mul_(2.0)
        llm.update_weights(hf)  # the same weights under HF names, in-process
        del hf
        rep.tokens_equal = tokens == [o.generated_tokens for o in llm.generate([[5, 17, 99, 3]], greedy)]
    finally:
        if proc.is_alive():
            proc.terminate()
        llm.close()
    return rep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-model", default="qwen3-0.6b")
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--layout", choices=["flat", "separate"], default="flat")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rep = run(args.default_model, args.updates, args.layout)
    with open(args.json, "w") as f:
        json.dump(asdict(rep), f)


if __name__ == "__main__":
    main()
