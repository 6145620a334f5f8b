"""CUDA IPC refit on one GPU, the colocated case: a trainer process holds a model's weights under
Megatron-Core names on the GPU the engine uses, in one flat bf16 buffer (``--layout flat``, as
Megatron-Core's DDP keeps them) or a storage per tensor (``--layout separate``, as a plain
GPTModel holds its parameters), shares them each step (``ipc.Sharer``: the same payload; a few
updates with every storage shared afresh, ``ipc.share``), and the engine copies from them
(``update_weights_from_ipc``). Times the first update (plan, mapping), the next ones (plan cached,
storages kept), with the default copy kernel ("auto": the table once compiled) and with
``torch._foreach_copy_`` lists, and one device copy
of the same bytes; checks that the trainer's in-place change arrives, that tensors moved to new
memory arrive (no old mapping read), that a payload from before ``release_after`` is refused, and
that the engine generates the tokens of the same weights given in-process under HF names.

With ``REFIT_PROFILE=DIR`` in the environment the first update runs under cProfile: its stats go
to ``DIR/<model>-<layout>-first.pstats`` and the top 40 by cumulative time to ``.txt`` beside it
(its ``first_ms`` then includes the profiler's overhead: ``profiled`` says so).

    python -m tests.helpers.refit_ipc_gpu --default-model qwen3-0.6b --layout separate --json out.json"""
from __future__ import annotations

import argparse
import json
import os
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
    """The first update: plan, mapping the storages, copy."""
    hot_ms: list[float] = field(default_factory=list)
    """Later updates of the same tensors (``ipc.Sharer``: the same payload), the table kernel. Each
    kind's list leaves out its first update: that one binds the copies anew after a change of
    kernel (foreach) or maps and releases what the kind changed, so the lists time repeats only."""
    fresh_ms: list[float] = field(default_factory=list)
    """The same with every storage shared afresh (``ipc.share``: a counter released per storage)."""
    foreach_ms: list[float] = field(default_factory=list)
    """The same as ``hot_ms`` with the copies launched as ``torch._foreach_copy_`` lists."""
    plan_hits: int = 0
    tensors: int = 0
    entries: int = 0
    """Storage entries of the first payload (one per allocator segment: fewer than the storages of
    the separate layout) and the storages the engine mapped for it."""
    mapped: int = 0
    launches: dict = field(default_factory=dict)
    """Kernel lists an update launches, by kernel."""
    kernels: dict = field(default_factory=dict)
    """The copy kernel each kind of update launched ("auto" resolved by the engine)."""
    phases: dict = field(default_factory=dict)
    """The engine's host time by phase (``WeightReceiver.last_ipc_ms``) of the first update and of
    the last of each kind."""
    change_arrived: bool = False
    tokens_equal: bool = False
    moved_arrived: bool = False
    """The trainer moved every tensor to new memory: the new values arrived (no old mapping read)."""
    moved_tokens_equal: bool = False
    stale_refused: bool = False
    """After ``release_after``, the payload from before it is refused (its references were released)."""
    profiled: bool = False
    """The first update ran under cProfile (``REFIT_PROFILE``): its ms is not comparable."""


def _profiled(call, arg, where: str | None, name: str):
    """``call(arg)``, under cProfile when ``where`` names a folder (``REFIT_PROFILE``): the stats to
    ``where/name.pstats`` and the top 40 by cumulative time to ``where/name.txt``."""
    if not where:
        return call(arg)
    import cProfile
    import io
    import pstats

    os.makedirs(where, exist_ok=True)
    prof = cProfile.Profile()
    try:
        return prof.runcall(call, arg)
    finally:
        prof.dump_stats(os.path.join(where, f"{name}.pstats"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        with open(os.path.join(where, f"{name}.txt"), "w") as f:
            f.write(text.getvalue())


def schedule(updates: int, repeats: int) -> list[str]:
    """What each update is, in order (the trainer and the engine follow the same list)."""
    return ["first", "change"] + ["hot"] * (updates - 2) + ["fresh"] * repeats + ["foreach"] * repeats + \
        ["moved", "release", "stale"]


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


def _moved(buffers: list[torch.Tensor], items: list[tuple], layout: str) -> tuple[list, list]:
    """Every tensor in new memory holding 1.5 x its values (the old memory freed)."""
    if layout == "separate":
        items = [(n, t * 1.5, s) for n, t, s in items]
        return [t for _, t, _ in items], items
    flat = buffers[0] * 1.5
    base = buffers[0].data_ptr()
    items = [(n, flat[(t.data_ptr() - base) // t.element_size():][: t.numel()].view(t.shape), s) for n, t, s in items]
    return [flat], items


def _trainer(port: int, shapes: dict, dims, arch: str, updates: int, layout: str, repeats: int) -> None:
    from megatron_async.weight_transfer import ipc

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    buffers, items = trainer_items(shapes, dims, arch, "cuda", layout)
    sharer, before_release = ipc.Sharer(), None
    for k, kind in enumerate(schedule(updates, repeats)):
        if kind == "change":
            for b in buffers:
                b.mul_(2.0)  # an optimizer step, in place: the engine must see it at the next update
        if kind == "moved":
            buffers, items = _moved(buffers, items, layout)
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        if kind == "fresh":
            payload = json.dumps(ipc.share(items))
        elif kind == "stale":
            payload = before_release
        else:
            payload = json.dumps(sharer.share(items, release_after=kind == "release"))
            before_release = payload
        store.set(f"payload/{k}", payload)
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


def _tokens(llm, greedy) -> list[list[int]]:
    return [o.generated_tokens for o in llm.generate([[5, 17, 99, 3]], greedy)]


def run(default_model: str, updates: int = 4, layout: str = "flat", repeats: int = 3) -> IpcReport:
    from megatron_async import LLM, InferenceConfig, SamplingParams
    from megatron_async.weight_transfer.ipc import IpcHandleError

    rep = IpcReport(default_model, layout)
    cfg = InferenceConfig(num_kv_blocks=64, max_requests=4, max_sequence_length=256)
    llm = LLM(default_model=default_model, device="cuda", dtype="bfloat16", inference_config=cfg)
    m, weights = llm.model, llm.engine.weights
    shapes, dims, arch = m.hf_shapes(), m.megatron_dims(), m.spec.name
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=600))
    proc = mp.get_context("spawn").Process(target=_trainer, args=(port, shapes, dims, arch, updates, layout, repeats),
                                           daemon=True)
    proc.start()
    probe = next(iter(llm.model.parameters()))
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True)
    times = {"hot": rep.hot_ms, "fresh": rep.fresh_ms, "foreach": rep.foreach_ms}
    profile = os.environ.get("REFIT_PROFILE") or None
    rep.profiled = profile is not None
    try:
        for k, kind in enumerate(schedule(updates, repeats)):
            payload = json.loads(store.get(f"payload/{k}"))
            weights.ipc_kernel = "foreach" if kind == "foreach" else "auto"  # the default; a change binds anew
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:  # (returns once its copies are done)
                _profiled(llm.engine.update_weights_from_ipc, payload, profile if kind == "first" else None,
                          f"{default_model}-{layout}-first")
            except IpcHandleError as e:
                rep.stale_refused = kind == "stale" and "stale entry" in str(e)
                if kind != "stale":
                    raise
            ms = 1e3 * (time.perf_counter() - t0)
            if kind == "first":
                rep.first_ms, before = ms, probe.detach().clone()
                rep.tensors, rep.entries = len(payload["tensors"]), len(payload["storages"])
                rep.mapped = weights._storages.opened
            if kind in times and k and schedule(updates, repeats)[k - 1] == kind:  # (not the first of its kind)
                times[kind].append(ms)
            if kind in ("first", "hot", "fresh", "foreach"):
                rep.phases[kind] = dict(weights.last_ipc_ms)
                rep.kernels[kind] = weights._bound[2]  # what "auto" took (the table once compiled)
                rep.launches[weights._bound[2]] = weights._bound[1].launches
            if kind == "change":
                rep.change_arrived = torch.equal(probe.float(), 2 * before.float())
                tokens = _tokens(llm, greedy)
            if kind == "moved":
                rep.moved_arrived = torch.equal(probe, before * 2.0 * 1.5)  # (the trainer's bf16 arithmetic)
                moved_tokens = _tokens(llm, greedy)
            store.set(f"done/{k}", "1")
        proc.join(120)
        rep.plan_hits = weights.plans.hits
        rep.weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        rep.copy_ms = copy_ms(rep.weight_bytes)
        for scales in ((2.0,), (2.0, 1.5)):
            hf = _hf_tensors(shapes, "cuda")
            for t in hf.values():
                for scale in scales:
                    t.mul_(scale)
            llm.update_weights(hf)  # the same weights under HF names, in-process
            del hf
            if len(scales) == 1:
                rep.tokens_equal = tokens == _tokens(llm, greedy)
            else:
                rep.moved_tokens_equal = moved_tokens == _tokens(llm, greedy)
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
    p.add_argument("--repeats", type=int, default=3, help="updates of each other kind (fresh shares, foreach)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rep = run(args.default_model, args.updates, args.layout, args.repeats)
    with open(args.json, "w") as f:
        json.dump(asdict(rep), f)


if __name__ == "__main__":
    main()
