"""Host time of a first weight update's plan, from metadata on a CPU: the Megatron-Core manifest of
the qwen3-0.6b shape (trainer TP 1) and of the qwen3-8b shape (trainer TP 4) planned against an
engine model built on the meta device, by phase, as ``update_weights_from_ipc`` /
``update_weights_from_distributed`` plan an update whose metadata is new.

Phases: ``table`` the model's lookups (``TargetTable``: built at engine start, not part of an
update), ``slabs`` (``weight_slabs``: Megatron names and shards -> boxes of HF tensors),
``check`` (names, shapes, dtypes, overlaps, coverage counted), ``verify``, ``program`` (the
destination views of every copy), ``plan`` their sum; ``parse`` (an IPC payload of the manifest
validated, its cache key built: every update) and ``bind`` (the trainer's tensors and the
source views of every copy: ``ipc.views``, ``CopyProgram.bind``) are the rest of a first IPC
update's host work before its copy; ``cached`` finds the plan of a repeated update.
Medians of ``--reps`` runs, each with the memos a new process has (none).

    OMP_NUM_THREADS=1 python -m benchmarks refit-plan [--reps 15] [--profile]
"""
from __future__ import annotations

import argparse
import base64
import cProfile
import os
import pstats
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from megatron_async.models import megatron_layouts  # noqa: E402
from megatron_async.models.default_model import DEFAULT_CONFIGS  # noqa: E402
from megatron_async.models.gpt import build_gpt  # noqa: E402
from megatron_async.models.megatron_layouts import Shard  # noqa: E402
from megatron_async.models.slab_loading import WeightPlan  # noqa: E402
from megatron_async.models.weight_targets import TargetTable  # noqa: E402
from megatron_async.models.weight_update import CopyPlanCache, weight_slabs  # noqa: E402
from megatron_async.weight_transfer import ipc  # noqa: E402
from tests.helpers.plan_reference import trainer_metas  # noqa: E402

SHAPES = (("qwen3-0.6b", 1), ("qwen3-8b", 4))
PHASES = ("table", "slabs", "check", "verify", "program", "plan", "parse", "bind", "cached")


def payload(metas: list[tuple]) -> dict:
    """An IPC payload of ``metas`` in one storage (handles that are never opened)."""
    fake = base64.b64encode(b"\0" * 64).decode()
    storage = {"kind": "cpu_shm", "manager": fake, "handle": fake, "nbytes": 0}
    tensors, offset = [], 0
    for name, shape, dtype, shard in metas:
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        tensors.append({"name": name, "storage": 0, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                        "stride": stride, "storage_offset": offset, "tp_rank": shard.tp_rank, "tp_size": shard.tp_size})
        offset += torch.Size(shape).numel()
    storage["nbytes"] = 2 * offset
    return {"weights_format": "megatron", "storages": [storage], "tensors": tensors}


def first_update(model, metas: list[tuple], handles: dict, flat: torch.Tensor) -> dict[str, float]:
    """One first update's host phases (ms), with the memos of a new process."""
    megatron_layouts._BOXES.clear()
    t = [time.perf_counter()]
    table = TargetTable(model).warm()
    t.append(time.perf_counter())
    slabs, inputs = weight_slabs(model, metas, "megatron")
    t.append(time.perf_counter())
    plan = WeightPlan(model, require_all=False, table=table)
    plan.check(slabs)
    t.append(time.perf_counter())
    plan.verify()
    t.append(time.perf_counter())
    program = plan.program(slabs, inputs, len(metas))
    t.append(time.perf_counter())
    _, _, tensors = ipc.parse(handles)
    ipc.plan_key("megatron", handles["storages"], tensors)
    t.append(time.perf_counter())
    program.bind(ipc.views([flat.untyped_storage()], tensors))
    t.append(time.perf_counter())
    ms = dict(zip(("table", "slabs", "check", "verify", "program", "parse", "bind"),
                  (1e3 * (b - a) for a, b in zip(t, t[1:]))))
    ms["plan"] = sum(ms[k] for k in ("slabs", "check", "verify", "program"))
    return ms


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--profile", action="store_true", help="cProfile one plan of each shape")
    args = p.parse_args(argv)
    rows = []
    for shape, tp in SHAPES:
        model = build_gpt(DEFAULT_CONFIGS[shape], torch.bfloat16, torch.device("meta"), None)
        metas = trainer_metas(model, [Shard(tp_rank=r, tp_size=tp) for r in range(tp)])
        handles = payload(metas)
        flat = torch.empty(handles["storages"][0]["nbytes"] // 2, dtype=torch.bfloat16, device="meta")
        runs = [first_update(model, metas, handles, flat) for _ in range(args.reps)]
        cache = CopyPlanCache()
        key = ("bench", tuple(metas))
        cache.get(model, key, metas, "megatron")
        cached = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            cache.get(model, key, metas, "megatron")
            cached.append(1e3 * (time.perf_counter() - t0))
        row = {k: statistics.median(r[k] for r in runs) for k in PHASES if k != "cached"}
        row.update(shape=shape, tp=tp, tensors=len(metas), cached=statistics.median(cached),
                   copies=sum(map(len, cache.get(model, key, metas, "megatron")[1].pairs)))
        rows.append(row)
        if args.profile:
            megatron_layouts._BOXES.clear()
            prof = cProfile.Profile()
            prof.runcall(cache.get, model, ("profile",), metas, "megatron")
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians of {args.reps} runs, ms\n")
    print("| shape | trainer TP | tensors | copies | " + " | ".join(PHASES) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(PHASES))
    for r in rows:
        print(f"| {r['shape']} | {r['tp']} | {r['tensors']} | {r['copies']} | "
              + " | ".join(f"{r[k]:.2f}" for k in PHASES) + " |")
    return rows


if __name__ == "__main__":
    main()
